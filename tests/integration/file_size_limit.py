"""Run `lisaft train` with a real write failure: from the moment named by the first argument, the
kernel refuses to grow any file past 4 KiB (RLIMIT_FSIZE, SIGXFSZ ignored, so writes fail with
EFBIG as they would on a full disk). Nothing is faked: checkpoint, metrics and export code meet
the failure in whatever library writes the file.

    python file_size_limit.py checkpoint|final|metrics RECIPE [lisaft train args...]

checkpoint: the second checkpoint write; final: the final export; metrics: the 6th record.
"""

import resource
import signal
import sys

LIMIT = 4096


def limit_files() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def arm(phase: str) -> None:
    from lisaft import checkpoint, metrics, trainer

    if phase == "checkpoint":
        original, calls = checkpoint.save_checkpoint, []

        def save(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                limit_files()
            return original(*args, **kwargs)

        checkpoint.save_checkpoint = save
    elif phase == "final":
        original_final = trainer._save_final

        def save_final(session):
            limit_files()
            return original_final(session)

        trainer._save_final = save_final
    elif phase == "metrics":
        original_write, records = metrics.MetricsLog.write, []

        def write(self, record):
            records.append(record)
            if len(records) == 6:
                # Below what the file already holds: the next append cannot grow it.
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                size = self.path.stat().st_size
                resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            return original_write(self, record)

        metrics.MetricsLog.write = write
    else:
        raise SystemExit(f"unknown phase {phase}")


if __name__ == "__main__":
    arm(sys.argv[1])
    from lisaft.cli import main

    sys.argv = ["lisaft", "train", *sys.argv[2:]]
    main()
