"""What a program's run means to whoever asked for it, in one word.

``succeeded`` is an exit 0 and nothing else; the others say why not.  The exec
result's ``status`` says what happened in the worker; this is the word an agent
checks: the CLI's ``krex exec --json`` (``outcome``) and the service's job
states use the same ones.  No imports: the CLI's lean path uses it.
"""

OUTCOMES = ("succeeded", "failed", "timed_out", "crashed", "cancelled")
_EXITED = "crashed: exited with status"  # os._exit(N) in the worker: an exit, not a crash


def outcome(status: str, exit_code: int, recycle_reason: str | None = None) -> str:
    """The outcome (one of :data:`OUTCOMES`) of a program that ended with ``status``
    (an exec result's: ``ok``, ``error``, ``timeout``, ``crashed``, ``recycled``,
    ``cancelled``) and ``exit_code``."""
    if status == "timeout":
        return "timed_out"
    if status == "cancelled":
        return "cancelled"
    if status in ("crashed", "recycled") and not (recycle_reason or "").startswith(_EXITED):
        return "crashed"
    return "succeeded" if exit_code == 0 else "failed"
