"""Run `lisaft train` or `lisaft resume` with a real write failure: from the moment named by the
first argument, the kernel refuses to grow any file past a size (RLIMIT_FSIZE, SIGXFSZ ignored,
so writes fail with EFBIG as they would on a full disk). Nothing is faked: checkpoint, metrics and
export code meet the failure in whatever library writes the file.

    python file_size_limit.py checkpoint|final|metrics|start|truncate|offload train|resume [args...]

checkpoint: the second checkpoint write; final: the final export; metrics: the 6th record (4 KiB
for these three); start: the run folder's recipe.yaml, written by `train` before anything else;
truncate: the rewrite of metrics.jsonl by `resume`; offload: the optimizer state that `resume`
offloads to disk while loading a checkpoint (16 bytes for these three).
"""

import resource
import signal
import sys

LIMIT = 4096


def limit_files(nbytes: int = LIMIT) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def arm(phase: str) -> None:
    from lisaft import run_folder as runfiles
    from lisaft.checkpoint import checkpointer as checkpoint
    from lisaft.metrics import log as runlog
    from lisaft.train import export

    if phase == "checkpoint":
        original, calls = checkpoint.Checkpointer.save, []

        def save(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                limit_files()
            return original(self, *args, **kwargs)

        checkpoint.Checkpointer.save = save
    elif phase == "final":
        original_final = export.save_final

        def save_final(session):
            limit_files()
            return original_final(session)

        export.save_final = save_final
    elif phase == "metrics":
        original_write, records = runlog.MetricsLog.write, []

        def write(self, record):
            records.append(record)
            if len(records) == 6:
                # Below what the file already holds: the next append cannot grow it.
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                size = self.path.stat().st_size
                resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            return original_write(self, record)

        runlog.MetricsLog.write = write
    elif phase == "start":
        original_make = runfiles.make_run_dir

        def make_run_dir(run_dir):
            original_make(run_dir)
            limit_files(16)

        runfiles.make_run_dir = make_run_dir
    elif phase == "truncate":
        original_truncate = runlog.MetricsLog.truncate_after

        def truncate_after(self, step):
            limit_files(16)
            return original_truncate(self, step)

        runlog.MetricsLog.truncate_after = truncate_after
    elif phase == "offload":
        from lisaft.checkpoint import optimizer_files

        original_read = optimizer_files.OptimizerFiles.read

        def read(self, *args, **kwargs):
            limit_files(16)
            return original_read(self, *args, **kwargs)

        optimizer_files.OptimizerFiles.read = read
    else:
        raise SystemExit(f"unknown phase {phase}")


if __name__ == "__main__":
    arm(sys.argv[1])
    from lisaft.cli import main

    sys.argv = ["lisaft", *sys.argv[2:]]
    main()
