"""kn.Engine (placeholder until the model area lands)."""


class Engine:
    def __init__(self, *a, **k):
        raise NotImplementedError("Engine not implemented yet")
