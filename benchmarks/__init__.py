"""lisaft's benchmarks, each run from the repository's root as `python -m benchmarks.NAME`.

Importing the package sets the process up as `lisaft` does (OpenMP's wait policy, the CUDA
allocator) before any benchmark imports torch, so what a benchmark times is what `lisaft train`
runs. benchmarks/common.py holds what several benchmarks share.
"""

from lisaft.env import configure_process

configure_process()
