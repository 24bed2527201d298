"""Structured-output constraints as SamplingParams carries them (vLLM's StructuredOutputsParams); compiled and
applied by m3serve.engine.structured. No xgrammar import here: plain requests never pay for it."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one of json (a JSON schema, as a dict or its JSON text), regex,
    choice (a list of strings), grammar (xgrammar EBNF) or json_object=True (any JSON object)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_flexible: bool = False    # allow any whitespace between JSON tokens (compact JSON otherwise)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice) if isinstance(self.choice, list) else self.choice)
        validate(self)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple:
        v = getattr(self, self.kind)
        if isinstance(v, dict):
            v = json.dumps(v, sort_keys=True)
        return self.kind, v, self.whitespace_flexible


def validate(p: StructuredOutputsParams) -> None:
    """Field types and 'exactly one constraint' (ValueError naming SamplingParams.structured_outputs.<field>);
    whether a schema / regex / grammar compiles is checked when the engine compiles it."""
    name = "SamplingParams.structured_outputs"
    given = [k for k in KINDS if getattr(p, k) not in (None, False)]
    if len(given) != 1:
        raise ValueError(f"{name}: expected exactly one of {', '.join(KINDS)}, found "
                         f"{', '.join(given) if given else 'none'}")
    if p.json is not None and not isinstance(p.json, (dict, str)):
        raise ValueError(f"{name}.json: expected a JSON schema (dict or JSON text), found {type(p.json).__name__}")
    if isinstance(p.json, str):
        try:
            if not isinstance(json.loads(p.json), (dict, bool)):
                raise ValueError
        except ValueError:
            raise ValueError(f"{name}.json: the text is not a JSON schema object") from None
    for field_name in ("regex", "grammar"):
        v = getattr(p, field_name)
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError(f"{name}.{field_name}: expected a non-empty string")
    if p.choice is not None and (not isinstance(p.choice, tuple) or not p.choice or
                                 not all(isinstance(c, str) and c for c in p.choice)):
        raise ValueError(f"{name}.choice: expected a non-empty list of non-empty strings")
    if p.json_object not in (None, True, False):
        raise ValueError(f"{name}.json_object: expected true or false")
    if not isinstance(p.whitespace_flexible, bool):
        raise ValueError(f"{name}.whitespace_flexible: expected true or false")


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of the strings (JSON string literals are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def as_structured(value) -> StructuredOutputsParams | None:
    """SamplingParams.structured_outputs from a StructuredOutputsParams, a dict of its fields, or None."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(KINDS) - {"whitespace_flexible"})
        if unknown:
            raise ValueError(f"SamplingParams.structured_outputs: unknown fields {unknown}; expected "
                             f"{', '.join(KINDS)} (and whitespace_flexible)")
        return StructuredOutputsParams(**value)
    raise ValueError(f"SamplingParams.structured_outputs: expected StructuredOutputsParams, a dict or None, found "
                     f"{type(value).__name__}")
