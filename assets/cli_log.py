"""The Dagster logger of the runs `qumem` launches: short lines on the terminal, everything in a file.

Dagster's default console logger prints every engine event (DEBUG) and each failure with its whole
stack trace. `qumem run` instead prints `HH:MM:SS step: message` for the steps' own messages at INFO
and above (the stages' progress lines, warnings, errors, each cut to its first line) and writes every
record in Dagster's full format, engine events and tracebacks included, to `log_file`; the CLI ends a
failed run with one line of its own (assets/cli_commands.py). Used only by the CLI
(`JobDefinition.with_logger_defs`); runs launched by the UI or the daemon keep Dagster's loggers.
"""

import logging
import re
import sys
import time

import dagster as dg


class _Stderr:
    """The current sys.stderr at each write (tests and callers may swap it)."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


def terminal_line(where: str, message: str, level: str = "") -> str:
    """`HH:MM:SS where: [LEVEL: ]first line of message` (the later lines are in the log file)."""
    lines = str(message).strip().splitlines() or [""]
    text = lines[0] + (" (details in the log)" if len(lines) > 1 else "")
    return f"{time.strftime('%H:%M:%S')} {where}: {level + ': ' if level else ''}{text}"


class _ShortFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        meta = getattr(record, "dagster_meta", None) or {}
        msg = str(meta.get("orig_message") or record.getMessage())
        where = meta.get("step_key") or meta.get("job_name") or "qumem"
        return terminal_line(where, msg, "" if record.levelno == logging.INFO else record.levelname)


class _StepMessagesOnly(logging.Filter):
    """The steps' own messages (progress, warnings, their errors); Dagster's engine events (step started,
    skipped after a failure, run failed, each with its stack trace) go to the log file only."""

    def filter(self, record: logging.LogRecord) -> bool:
        meta = getattr(record, "dagster_meta", None) or {}
        if meta.get("dagster_event") is not None:
            return False
        # the engine's note on each step skipped after a failure (a plain message, not an event)
        return not _SKIPPED.match(str(meta.get("orig_message") or ""))


_SKIPPED = re.compile(r"^Dependencies for step \S+ (failed|were not executed)")


FULL_FORMAT = "%(asctime)s - %(levelname)s - %(message)s"


@dg.logger(
    config_schema={
        "log_level": dg.Field(str, default_value="INFO", description="threshold of the terminal lines"),
        "log_file": dg.Field(str, description="every record, tracebacks included, is appended here"),
    },
    description="qumem CLI: short terminal lines, full log in a file.",
)
def qumem_cli_logger(init_context) -> logging.Logger:
    cfg = init_context.logger_config
    logger = logging.Logger("qumem", level=logging.DEBUG)
    term = logging.StreamHandler(_Stderr())
    term.setLevel(cfg["log_level"].upper())
    term.setFormatter(_ShortFormatter())
    term.addFilter(_StepMessagesOnly())
    logger.addHandler(term)
    file = logging.FileHandler(cfg["log_file"], encoding="utf-8")
    file.setLevel(logging.DEBUG)
    file.setFormatter(logging.Formatter(FULL_FORMAT))
    logger.addHandler(file)
    return logger


def with_cli_logger(job: dg.JobDefinition, log_file: str) -> tuple[dg.JobDefinition, dict]:
    """`job` logging through `qumem_cli_logger` only, and the run config that selects it."""
    return (job.with_logger_defs({"qumem": qumem_cli_logger}),
            {"loggers": {"qumem": {"config": {"log_file": log_file}}}})
