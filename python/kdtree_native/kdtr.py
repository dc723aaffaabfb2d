"""KDTR container: Python writer/reader (placeholder until the KDTR area lands)."""


def save_kdtr(path, arrays, metadata=None):
    raise NotImplementedError("KDTR writer not implemented yet")


def load_kdtr(path, mmap=True):
    raise NotImplementedError("KDTR reader not implemented yet")
