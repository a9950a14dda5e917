"""Textual model specs: ``family:key=value,...`` accepted wherever a model name is.

  gpt:layers=24,hidden=2304,heads=24,vocab=51200,seq=2048[,ffn=..,kv_heads=..,
      pos=learned|rope,norm=layernorm|rmsnorm,mlp=gelu|swiglu,tied=true|false,bias=..]
  vit:layers=12,hidden=768,heads=12,ffn=3072,patch=16,image=224[,cls_token=..]
  mllm:vision=<vit preset>,text=<gpt preset>[,projector=mlp|linear]

Values are coerced to the config field's type; a key the family does not have,
a value of the wrong type or a missing required key raises ``SpecError``.
"""

from __future__ import annotations

import dataclasses
import typing

from hetshard import SpecError, SpecParseError, UnknownNameError

from .gpt import GPTConfig
from .mllm import MLLMConfig
from .vit import ViTConfig

FAMILIES = {"gpt": GPTConfig, "vit": ViTConfig, "mllm": MLLMConfig}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _coerce(cls, key: str, text: str, spec: str):
    hints = typing.get_type_hints(cls)
    kind = hints[key]
    args = typing.get_args(kind)
    base = next((a for a in args if a is not type(None)), kind) if args else kind
    if base is bool:
        if text.lower() not in _BOOLS:
            raise SpecError(key, text, "true or false", where=f"model spec {spec!r}")
        return _BOOLS[text.lower()]
    if base is int:
        try:
            return int(text)
        except ValueError:
            raise SpecError(key, text, "an integer", where=f"model spec {spec!r}") from None
    if base is float:
        try:
            return float(text)
        except ValueError:
            raise SpecError(key, text, "a number", where=f"model spec {spec!r}") from None
    if base is ViTConfig or base is GPTConfig:
        from . import resolve
        cfg = resolve(text)
        if not isinstance(cfg, base):
            raise SpecError(key, text, f"a {base.__name__} preset or spec",
                            where=f"model spec {spec!r}")
        return cfg
    return text


def parse_model_spec(spec: str):
    """Parses ``family:key=value,...`` into a frozen model config."""
    family, sep, body = spec.partition(":")
    if not sep:
        raise SpecParseError(f"model spec {spec!r}", "expected 'family:key=value,...'")
    if family not in FAMILIES:
        raise UnknownNameError("model family", family, FAMILIES, where=f"model spec {spec!r}")
    cls = FAMILIES[family]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, object] = {"name": spec}
    # mllm's values are themselves names; split on commas outside nothing fancy.
    for item in filter(None, (p.strip() for p in body.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not value.strip():
            raise SpecParseError(f"model spec {spec!r}", f"item {item!r} is not key=value")
        if key not in fields or key == "name":
            accepted = sorted(k for k in fields if k != "name")
            raise SpecError(key, value, f"a key among {accepted}",
                            where=f"model spec {spec!r}")
        if key in kwargs:
            raise SpecError(key, value, "each key once", where=f"model spec {spec!r}")
        kwargs[key] = _coerce(cls, key, value.strip(), spec)
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise SpecError(missing[0], None, f"a value for every required key {missing}",
                        where=f"model spec {spec!r}")
    return cls(**kwargs)
