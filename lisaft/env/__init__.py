"""The process lisaft runs in: its settings that must be made before torch loads."""


def configure_process() -> None:
    """OpenMP's wait policy and the CUDA caching allocator's setting, each read once by torch (when
    it loads OpenMP, when CUDA is first used): call before importing torch. The command line and
    every benchmark (benchmarks/__init__.py) call it, so a benchmark times the process `lisaft
    train` runs in."""
    from lisaft.env.allocator import configure_cuda_allocator
    from lisaft.env.threads import configure_openmp

    configure_openmp()
    configure_cuda_allocator()
