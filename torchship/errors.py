"""The typed errors every stage raises; the CLI prints them as one line and exits non-zero."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """``e`` as one short line: its type and the first line of its message (cut to ``limit`` characters), for
    an error that goes on into a message of ours, a manifest or a report."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"


def root_cause(e: BaseException, limit: int = 300) -> str:
    """first_line of the innermost error ``e`` was raised from (a wrapper's own message often says only that
    something failed), without terminal colour codes."""
    import re

    inner = e.__cause__ or e.__context__
    while inner is not None and str(inner).strip():
        e, inner = inner, inner.__cause__ or inner.__context__
    return re.sub(r"\x1b\[[0-9;]*m", "", first_line(e, limit))


class TorchshipError(Exception):
    """A problem the user can act on. ``str(err)`` is the one line the CLI prints."""

    exit_code = 2


class ConfigError(TorchshipError):
    """An option or config file value is invalid; the message names the flag to change."""


class DataError(TorchshipError):
    """The dataset is missing, empty or unusable."""


class CheckpointError(TorchshipError):
    """A checkpoint is missing, corrupt, or does not match the model it is loaded into."""


class ArtifactError(TorchshipError):
    """An exported artifact or export directory is missing, altered or cannot be produced."""


OPTIONAL_HINT = "--optional FORMAT lets a format fail without failing the command"


class ParityError(TorchshipError):
    """A requested format cannot be exported, or outputs of an artifact or a served model differ from the
    reference beyond their bound. ``hint`` ends the line: where to read more, what to change."""

    exit_code = 3

    def __init__(self, failures: list[str], what: str = "parity check", hint: str = ""):
        self.failures = list(failures)
        head = f"{what} failed ({len(self.failures)} problem{'s' if len(self.failures) != 1 else ''}): "
        super().__init__(head + "; ".join(self.failures) + (f" ({hint})" if hint else ""))


class DegenerateError(TorchshipError):
    """Eager's outputs do not depend on the inputs, so no comparison against them can fail."""

    exit_code = 3


class ShapeError(TorchshipError):
    """An input has the wrong rank, shape or dtype for the model contract."""


class ServerError(TorchshipError):
    """The Triton server could not be started, reached, or did not become ready."""


class ClientError(TorchshipError):
    """A request to a served model failed."""


class AccessError(ClientError):
    """A server refused a call for want of its control key, or a TLS connection could not be made; the
    message says what to give."""


class BenchError(TorchshipError):
    """A benchmark could not run or its inputs are unusable (partial results are kept)."""


class GateError(TorchshipError):
    """A pipeline gate failed in ``torchship run``; the message names the stage."""

    exit_code = 3


class Interrupted(TorchshipError):
    """Ctrl-C or SIGTERM stopped a command; the message says where, and how to go on."""

    exit_code = 130


class RolloutError(TorchshipError):
    """A rollout step failed; the live version still serves."""

    exit_code = 3
