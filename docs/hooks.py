"""MkDocs hook: the reference pages, generated from the code at every build.

A page asks for a generated part with a marker on a line of its own:

- ``<!-- streamrec:config-reference -->``: every key of the job YAML, walked from
  the pydantic schema (``deploy.config.JobConfig``): dotted path, type and
  constraints, default, description.
- ``<!-- streamrec:cli-reference -->``: every ``streamrec`` command, walked from
  the argparse parsers (``deploy.cli.build_parser()``), nested groups included.
- ``<!-- streamrec:deadletter-reasons -->``: why a record can be dead-lettered
  (``connectors.validate.REASONS``).

The schema and the parsers are the one source, so these pages cannot drift from
the code. An unknown marker fails the build, so a misspelled one is not left as
an empty spot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from mkdocs.exceptions import PluginError
from pydantic import BaseModel
from pydantic.fields import FieldInfo

MARKER = re.compile(r"^<!--\s*streamrec:([a-z-]+)\s*-->$", re.MULTILINE)

# How a key inside a mapping and an item of a list show in a dotted path.
MAP_KEY = "<name>"
LIST_ITEM = "[]"


def on_page_markdown(markdown: str, **_: Any) -> str:
    def expand(match: re.Match[str]) -> str:
        name = match.group(1)
        render = GENERATORS.get(name)
        if render is None:
            msg = f"unknown marker 'streamrec:{name}' (known: {', '.join(sorted(GENERATORS))})"
            raise PluginError(msg)
        return render()

    return MARKER.sub(expand, markdown)


# --- the job YAML, from the pydantic schema ----------------------------------------------


@dataclass
class Key:
    path: str
    type: str
    default: str
    description: str


@dataclass
class Section:
    path: str
    model: type[BaseModel]
    variant: str | None = None
    optional: bool = False
    keys: list[Key] = field(default_factory=list)


def _unwrap(tp: Any) -> tuple[Any, list[Any]]:
    """The type inside ``Annotated[...]`` layers, and their metadata in order."""
    metadata: list[Any] = []
    while typing.get_origin(tp) is Annotated:
        tp, *extra = typing.get_args(tp)
        metadata.extend(extra)
    return tp, metadata


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` as (X, True); anything else as (it, False)."""
    tp, _ = _unwrap(tp)
    if _is_union(tp):
        members = [m for m in typing.get_args(tp) if m is not type(None)]
        if len(members) < len(typing.get_args(tp)):
            inner = members[0] if len(members) == 1 else typing.Union[tuple(members)]  # noqa: UP007
            return _unwrap(inner)[0], True
    return tp, False


def _variants(tp: Any) -> list[type[BaseModel]] | None:
    """The models of a union of models (a discriminated union), else None."""
    if not _is_union(tp):
        return None
    members = [_unwrap(m)[0] for m in typing.get_args(tp)]
    if members and all(_is_model(m) for m in members):
        return members
    return None


def _kind(model: type[BaseModel]) -> str:
    kind = model.model_fields.get("kind")
    return str(kind.default) if kind is not None else model.__name__


def walk_config(model: type[BaseModel], prefix: str = "") -> Iterator[Section]:
    """Every model of the schema as a section of its plain keys, parents first."""
    yield from _walk(Section(prefix, model))


def _walk(section: Section) -> Iterator[Section]:
    nested: list[Section] = []
    fields = sorted(section.model.model_fields.items(), key=lambda kv: kv[0] != "kind")
    for name, info in fields:
        path = f"{section.path}.{name}" if section.path else name
        tp, optional = _split_optional(info.annotation)
        origin = typing.get_origin(tp)
        children: list[Section] = []
        if _is_model(tp):
            children = [Section(path, tp, optional=optional)]
            kind = "section"
        elif (models := _variants(tp)) is not None:
            children = [Section(path, m, variant=_kind(m), optional=optional) for m in models]
            kind = "section, one of " + ", ".join(f"`kind: {_kind(m)}`" for m in models)
        elif origin is dict and _is_model(item := _unwrap(typing.get_args(tp)[1])[0]):
            children = [Section(f"{path}.{MAP_KEY}", item)]
            kind = f"mapping of name to section `{path}.{MAP_KEY}`"
        elif origin is list and _is_model(item := _unwrap(typing.get_args(tp)[0])[0]):
            children = [Section(f"{path}{LIST_ITEM}", item)]
            kind = f"list of sections `{path}{LIST_ITEM}`"
        if children:
            # The section itself is a row too, so each table shows its whole level.
            first = (
                _model_doc(children[0].model).split("\n\n")[0]
                if len(children) == 1
                else "one section per `kind`, below"
            )
            section.keys.append(Key(path, kind, _default(info), first))
            nested += children
        else:
            section.keys.append(
                Key(path, _type_text(info.annotation, info.metadata), _default(info), _doc(info))
            )
    yield section
    for child in nested:
        yield from _walk(child)


_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def _constraints(metadata: list[Any], *, text: bool = False) -> list[str]:
    out: list[str] = []
    for item in metadata:
        if isinstance(item, FieldInfo):
            out += _constraints(item.metadata, text=text)
            continue
        for attr, sign in _BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{sign} {_number(value)}")
        if (n := getattr(item, "min_length", None)) is not None:
            if text:
                out.append("not empty" if n == 1 else f"at least {n} characters")
            else:
                out.append(f"at least {n} item{'s' if n != 1 else ''}")
        if (n := getattr(item, "max_length", None)) is not None:
            out.append(f"at most {n}")
        if (pattern := getattr(item, "pattern", None)) is not None:
            out.append(f"matches `{pattern}`")
    return out


def _number(value: object) -> str:
    if isinstance(value, int) and value >= 1 << 16 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    if isinstance(value, int) and value >= 1 << 16 and (value + 1) & value == 0:
        return f"2^{value.bit_length()} - 1"
    return str(value)


_NAMES = {bool: "bool", int: "int", float: "float", str: "str", Path: "path"}


def _type_text(tp: Any, metadata: list[Any] | None = None, *, nested: bool = False) -> str:
    """A type as a reader of YAML sees it: ``int, ≥ 1``, ```a` or `b```, ``list of str``.

    Constraints of an inner type (a list's items) go in parentheses after it.
    """
    tp, inner = _unwrap(tp)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    bounds = _constraints([*(metadata or []), *inner], text=tp is str)
    if tp in _NAMES:
        text = _NAMES[tp]
    elif tp is Any:
        text = "any"
    elif origin is Literal:
        text = " or ".join(f"`{a}`" for a in args)
    elif _is_union(tp):
        text = " or ".join("null" if a is type(None) else _type_text(a, nested=True) for a in args)
    elif origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        text = f"list of {_type_text(args[0], nested=True)}"
    elif origin is tuple:
        text = "[" + ", ".join(_type_text(a, nested=True) for a in args) + "]"
    elif origin is dict:
        value = _type_text(args[1], nested=True)
        key = _type_text(args[0], nested=True)
        text = "mapping" if value == "any" else f"mapping of {key} to {value}"
    else:
        text = getattr(tp, "__name__", str(tp))
    if not bounds:
        return text
    return f"{text} ({', '.join(bounds)})" if nested else ", ".join([text, *bounds])


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return json.dumps([v if isinstance(v, int | float | str) else str(v) for v in value])
    if isinstance(value, dict):
        return json.dumps(value) if value else "{}"
    return str(value)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        kind = getattr(value, "kind", None)
        return f"`kind: {kind}`" if kind is not None else "its defaults"
    text = _yaml(value)
    if len(text) > 60:
        count = f" ({len(value)} values)" if isinstance(value, tuple | list) else ""
        text = text[:56] + " …" + count
    return f"`{text}`"


def _doc(info: FieldInfo) -> str:
    return _escape(" ".join((info.description or "").split()))


def _escape(text: str) -> str:
    """Markdown table text: no raw HTML (``<run_dir>``), no column breaks, no emphasis."""
    out = []
    # Code spans stay as written; only the text between them is escaped.
    for i, part in enumerate(re.split(r"(`[^`]*`)", text)):
        plain = part
        if i % 2 == 0:
            plain = plain.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            plain = plain.replace("*", r"\*").replace("_", r"\_")
        out.append(plain.replace("|", r"\|"))
    return "".join(out)


def _model_doc(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or "").strip()
    if not doc or doc.startswith(f"{model.__name__}("):  # pydantic's generated signature
        return ""
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
    # Doctest examples are for the code's readers, not the YAML's.
    kept = [p for p in paragraphs if not p.startswith(">>>")]
    return "\n\n".join(_escape(p.replace("``", "`")) for p in kept)


def config_reference() -> str:
    from deploy.config import JobConfig

    out: list[str] = []
    for section in walk_config(JobConfig):
        title = f"`{section.path}`" if section.path else "Top level"
        if section.variant is not None:
            title += f" — `kind: {section.variant}`"
        out.append(f"## {title}\n")
        if section.optional and section.variant is None:
            out.append("Optional: the whole section may be left out.\n")
        if doc := _model_doc(section.model):
            out.append(doc + "\n")
        if section.keys:
            out.append("| key | type | default | description |")
            out.append("| --- | --- | --- | --- |")
            for k in section.keys:
                out.append(f"| `{k.path}` | {_escape(k.type)} | {k.default} | {k.description} |")
            out.append("")
    return "\n".join(out)


# --- the command line, from the argparse parsers ----------------------------------------


@dataclass
class Command:
    path: str
    parser: argparse.ArgumentParser
    summary: str


def walk_commands(parser: argparse.ArgumentParser, prog: str = "streamrec") -> Iterator[Command]:
    """Every command and command group, depth first, in the order ``--help`` lists them."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        summaries = {a.dest: a.help or "" for a in action._choices_actions}
        for name, sub in action.choices.items():
            path = f"{prog} {name}"
            yield Command(path, sub, summaries.get(name, ""))
            yield from walk_commands(sub, path)


def _help_text(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        # argparse's own expansion: %(default)s and the like; a literal % stays as is.
        with contextlib.suppress(KeyError, TypeError, ValueError):
            text = text % {**vars(action), "prog": prog}
    return _escape(" ".join(text.split()))


def _argument(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(action.option_strings)
        takes = action.nargs != 0
        metavar = action.metavar or (action.dest.upper() if takes else None)
        if isinstance(metavar, tuple):
            metavar = " ".join(metavar)
        return f"`{names} {metavar}`" if metavar else f"`{names}`"
    metavar = action.metavar or action.dest
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    return f"`{metavar}`"


def _arg_default(action: argparse.Action) -> str:
    if action.required and action.option_strings:
        return "required"
    if action.option_strings and action.nargs == 0:
        return ""  # a flag: absent or given
    value = action.default
    if value is None or value is argparse.SUPPRESS or value == []:
        return ""
    return f"`{_yaml(value)}`"


def cli_reference() -> str:
    from deploy.cli import build_parser

    out: list[str] = []
    for cmd in walk_commands(build_parser()):
        depth = cmd.path.count(" ")
        out.append(f"{'#' * min(depth + 1, 6)} `{cmd.path}`\n")
        if cmd.summary:
            out.append(_escape(cmd.summary[:1].upper() + cmd.summary[1:]) + ".\n")
        if cmd.parser.description and cmd.parser.description != cmd.summary:
            out.append(_escape(" ".join(cmd.parser.description.split())) + "\n")
        usage = cmd.parser.format_usage().removeprefix("usage: ").strip()
        out.append(f"```text\n{usage}\n```\n")
        rows = [
            a
            for a in cmd.parser._actions
            if a.help is not argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        ]
        if rows:
            out.append("| argument | default | description |")
            out.append("| --- | --- | --- |")
            for a in rows:
                help_text = _help_text(a, cmd.path)
                if a.choices is not None and not a.metavar:
                    listed = "One of " + ", ".join(f"`{c}`" for c in a.choices) + "."
                    help_text = f"{help_text.rstrip('.')}. {listed}" if help_text else listed
                out.append(f"| {_argument(a)} | {_arg_default(a)} | {help_text} |")
            out.append("")
        if cmd.parser.epilog:
            out.append(f"```text\n{cmd.parser.epilog.strip()}\n```\n")
    return "\n".join(out)


# --- records that are dead-lettered ------------------------------------------------------


def deadletter_reasons() -> str:
    from connectors.validate import REASONS

    rows = [f"| `{reason}` | {_escape(meaning)} |" for reason, meaning in REASONS.items()]
    return "\n".join(["| reason | meaning |", "| --- | --- |", *rows, ""])


GENERATORS: dict[str, Callable[[], str]] = {
    "config-reference": config_reference,
    "cli-reference": cli_reference,
    "deadletter-reasons": deadletter_reasons,
}
