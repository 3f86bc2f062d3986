"""Chat messages -> prompt text through the tokenizer's own chat template, rendered as transformers
renders it: a sandboxed Jinja2 environment (templates come with downloaded checkpoints, so they
must not reach Python objects), `trim_blocks` / `lstrip_blocks`, the `loopcontrols` extension, and
the helpers templates call (`raise_exception`, `tojson`, `strftime_now`), with the tokenizer's
special tokens (`bos_token`, `eos_token`, ...) as variables.

The template is read from the checkpoint folder: `chat_template.jinja` if present (newer
transformers save it there), else `tokenizer_config.json`'s `chat_template`, a string or a list of
named templates (the one named "default" is used).
"""

from __future__ import annotations

import datetime
import json
import os

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the messages (e.g. `raise_exception("roles must alternate")`) or is broken."""


def _raise_exception(message):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates want the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _token_text(value):
    # tokenizer_config.json stores special tokens as strings or as serialized AddedTokens.
    if isinstance(value, dict):
        return value.get("content")
    return value


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools=None, **extra) -> str:
        """The prompt text of messages (dicts with role and text content)."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **self.special_tokens, **extra)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from e

    @classmethod
    def from_dir(cls, path) -> ChatTemplate | None:
        """The template shipped in checkpoint folder path, or None when it has none."""
        if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
            return None
        config = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        specials = {k: _token_text(v) for k, v in config.items()
                    if k.endswith("_token") and isinstance(_token_text(v), str)}
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path) as f:
                return cls(f.read(), specials)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        return cls(source, specials) if isinstance(source, str) else None
