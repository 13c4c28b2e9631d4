"""The request bodies, validated (pydantic): every field typed and bounded, nothing extra.

The same models give the OpenAPI schema of the HTTP app and the JSON schemas
of the MCP tools.  ``strict``: a string is not a number, a number is not a
string; unknown fields are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEVICE = r"^(cpu|fakegpu:\d{1,3}|cuda:\d{1,3}|rocm:\d{1,3})$"
FUNCTION = r"^[A-Za-z_][A-Za-z0-9_]{0,99}$"
SPEC = r"^[^\s:][^:]{0,1023}\.py:[A-Za-z_][A-Za-z0-9_]{0,99}$"

Device = Annotated[str | None, Field(default=None, pattern=DEVICE,
                                     description="cpu, fakegpu:N, cuda:N or rocm:N "
                                                 "(default: $KREX_DEVICE, else cpu)")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Source(_Body):
    """A function given as source text: the module ``source`` defines ``function``."""

    source: str = Field(min_length=1, max_length=200_000)
    function: str = Field(pattern=FUNCTION)


CodeRef = Annotated[str | Source, Field(description="`path.py:function` on the node, or "
                                                    "{source, function}")]


class FileSource(_Body):
    """A whole Python file given as its text."""

    source: str = Field(min_length=1, max_length=200_000)


FileRef = Annotated[str | FileSource, Field(description="`path.py` on the node, or {source}")]


class ExecBody(_Body):
    """Run a Python program in a warm worker: its source (``program``) or a node path."""

    program: str | None = Field(default=None, min_length=1, max_length=200_000,
                                description="the program's source text")
    path: str | None = Field(default=None, min_length=1, max_length=4096,
                             description="or: the path of a .py file on the node")
    args: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list,
                                                               max_length=256)
    device: Device = None
    timeout_s: float = Field(default=60.0, gt=0, le=600)
    env: dict[str, Annotated[str, Field(max_length=8192)]] = Field(default_factory=dict,
                                                                   max_length=64)

    @model_validator(mode="after")
    def _one_program(self) -> ExecBody:
        if (self.program is None) == (self.path is None):
            raise ValueError("give exactly one of `program` (source text) or `path`")
        if self.path is not None:
            _absolute("path", self.path)
        return self


class EvaluateBody(_Body):
    """``krex.evaluate``: is the candidate correct against the reference, and faster?"""

    reference: CodeRef | None = None
    candidate: CodeRef | None = None
    inputs: CodeRef | None = Field(default=None, description="inputs builder: make(seed) or "
                                                             "make(seed, shape)")
    problem: FileRef | None = Field(default=None, description="or a KernelBench pair: the "
                                    "problem (Model, get_inputs, get_init_inputs) ...")
    solution: FileRef | None = Field(default=None, description="... and the solution "
                                     "(ModelNew), in place of reference, candidate, inputs")
    device: Device = None
    seeds: int = Field(default=3, ge=1, le=32)
    shapes: list[Any] | None = Field(default=None, max_length=16,
                                     description="shapes[0] is timed, the rest held out")
    atol: float | None = Field(default=None, ge=0)
    rtol: float | None = Field(default=None, ge=0)
    cache: Literal["cold", "hot"] = "cold"
    timeout_s: float = Field(default=120.0, gt=0, le=1800)
    fresh: bool = False

    @model_validator(mode="after")
    def _specs(self) -> EvaluateBody:
        import re

        functions = [getattr(self, side) for side in ("reference", "candidate", "inputs")]
        pair = [self.problem, self.solution]
        if all(v is not None for v in pair) and all(v is None for v in functions):
            if self.shapes is not None:
                raise ValueError("shapes: a KernelBench problem's get_inputs() fixes them")
            for side, value in (("problem", self.problem), ("solution", self.solution)):
                if isinstance(value, str) and not value.endswith(".py"):
                    raise ValueError(f"{side}: not a `.py` file: {value[:80]!r}")
                if isinstance(value, str):
                    _absolute(side, value)
            return self
        if any(v is None for v in functions) or any(v is not None for v in pair):
            raise ValueError("give reference, candidate and inputs, or a KernelBench pair: "
                             "problem and solution")
        for side in ("reference", "candidate", "inputs"):
            value = getattr(self, side)
            if isinstance(value, str) and not re.match(SPEC, value):
                raise ValueError(f"{side}: not `path.py:function`: {value[:80]!r}")
            if isinstance(value, str):
                _absolute(side, value)
        return self


def _absolute(field: str, path: str) -> None:
    """A node path must be absolute: the service's working directory is not the caller's."""
    if not path.startswith("/"):
        raise ValueError(f"{field}: {path[:80]!r} is relative; give an absolute path on the "
                         "node (the service does not share your working directory) or send "
                         "the source itself")


class BenchBody(_Body):
    """Time a command inside a region (hyperfine-style)."""

    command: str | list[Annotated[str, Field(max_length=4096)]] = Field(
        description="a shell command, or an argv list run as given")
    device: Device = None
    runs: int | None = Field(default=None, ge=1, le=10_000)
    warmup: int = Field(default=1, ge=0, le=100)
    budget_s: float = Field(default=1.0, gt=0, le=60)
    timeout_s: float | None = Field(default=None, gt=0, le=600)

    @model_validator(mode="after")
    def _nonempty(self) -> BenchBody:
        if not self.command or (isinstance(self.command, list) and not self.command[0]):
            raise ValueError("command must not be empty")
        return self


BODIES: dict[str, type[_Body]] = {"exec": ExecBody, "evaluate": EvaluateBody,
                                  "bench": BenchBody}


def job_request(kind: str, body: _Body) -> dict[str, Any]:
    """The job's stored request: the body as JSON, ``None`` fields left out, bench's
    argv marked (a list is run as given)."""
    data = body.model_dump(mode="json", exclude_none=True)
    if kind == "bench" and isinstance(data["command"], list):
        data["shell"] = None
    return data
