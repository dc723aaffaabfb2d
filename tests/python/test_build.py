import kdtree_native as kn


def test_build_info_fields():
    info = kn.build_info()
    for key in ("version", "compiler", "cpu_blas", "cuda", "cuda_archs", "cublas", "cuda_available"):
        assert key in info, key
    assert info["version"] == kn.__version__
    assert isinstance(kn.cuda_available(), bool)
    if not info["cuda"]:
        assert kn.cuda_available() is False
