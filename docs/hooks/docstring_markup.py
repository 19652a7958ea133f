"""A griffe extension that turns torchpmap's docstring markup into what mkdocstrings renders.

The docstrings are Google style with a few reStructuredText habits, which mkdocstrings
would otherwise show literally or mangle:

* ``:func:`psum``` (and ``:class:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:exc:``,
  ``:data:``, ``~`` included) becomes a link to the API reference when the target is
  documented there (``docs/api/*.md``), else inline code;
* an ``Example:`` section (singular; griffe only parses ``Examples:`` as doctest) becomes
  ``Examples:``, and ``Example (some words):`` becomes the words plus ``Examples:``, when
  a doctest follows;
* a doctest (``>>>`` lines) outside an ``Examples:`` section is wrapped in a ```pycon
  fence (otherwise markdown reads ``>>>`` as nested block quotes);
* a paragraph ending in ``::`` (a reST literal block follows) ends in ``:``.

The source files are not changed: this runs on the docstrings griffe loaded. Enabled in
mkdocs.yml (``extensions:`` of the python handler).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

_API_PAGES = Path(__file__).resolve().parent.parent / "api"
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|exc|data|obj):`(~?)\.?([\w.]+)(?:\(\))?`")
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$")
_MEMBER = re.compile(r"^\s+-\s+([\w]+)\s*$")
_EXAMPLE_HEADER = re.compile(r"^(?P<indent>\s*)Examples?\s*(?:\((?P<words>.*)\))?\s*::?\s*$")
_PROMPT = re.compile(r"^(?P<indent>\s*)>>>( |$)")


def _documented() -> tuple[set[str], dict[str, list[str]]]:
    """The identifiers the API pages document: ``::: path`` roots, and the members
    listed under ``members:`` (for module directives)."""
    roots: set[str] = set()
    members: dict[str, list[str]] = {}
    for page in sorted(_API_PAGES.glob("*.md")):
        current = None
        for line in page.read_text(encoding="utf-8").splitlines():
            m = _DIRECTIVE.match(line)
            if m:
                current = m.group(1)
                roots.add(current)
                continue
            m = _MEMBER.match(line)
            if m and current is not None:
                members.setdefault(current, []).append(m.group(1))
            elif line and not line.startswith(" "):
                current = None
    return roots, members


class DocstringMarkup(griffe.Extension):
    def __init__(self) -> None:
        super().__init__()
        self.roots, self.members = _documented()
        self.targets: set[str] = set()

    # ------------------------------------------------------------------ griffe hook

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "torchpmap":
            return
        self.targets = self._targets(pkg)
        for obj in self._walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = self.convert(obj.docstring.value, obj)

    # ------------------------------------------------------------------ what can be linked

    def _targets(self, pkg: griffe.Module) -> set[str]:
        """Identifiers with an anchor in the rendered API reference."""
        targets: set[str] = set()

        def add(path: str, obj: Any) -> None:
            targets.add(path)
            obj = obj.final_target if obj.is_alias else obj
            if obj.is_class:  # its public methods and attributes get anchors too
                targets.update(f"{path}.{m}" for m in obj.members if not m.startswith("_"))

        for root in self.roots:
            obj = self._lookup(pkg, root)
            if obj is None:
                continue
            if obj.is_module:
                for name in self.members.get(root, []):
                    if name in obj.members:
                        add(f"{root}.{name}", obj.members[name])
            else:
                add(root, obj)
        return targets

    @staticmethod
    def _lookup(pkg: griffe.Module, path: str) -> Any:
        if path == pkg.path:
            return pkg
        try:
            return pkg[path[len(pkg.path) + 1 :]]
        except (KeyError, griffe.AliasResolutionError):
            return None

    def _resolve(self, name: str, obj: Any) -> str | None:
        """The documented identifier that ``name``, written in ``obj``'s docstring, means."""
        # torchpmap._collectives.public.psum -> torchpmap.psum: a layer folder goes with its module
        public = lambda path: re.sub(r"\._(?:frontend|collectives|placement|state)\.\w+|\._\w+", "", path)
        module = obj.path if obj.is_module else obj.module.path
        candidates = [name, public(name), f"{public(module)}.{name}", f"torchpmap.{name}",
                      f"torchpmap.training.{name}", f"torchpmap.distributed.{name}"]
        if obj.parent is not None and obj.parent.is_class:
            candidates.insert(1, f"{public(obj.parent.path)}.{name}")
        return next((c for c in candidates if c in self.targets), None)

    # ------------------------------------------------------------------ rewriting

    def convert(self, text: str, obj: griffe.Object) -> str:
        text = self._roles(text, obj)
        lines = text.splitlines()
        lines = self._example_headers(lines)
        lines = self._fence_free_doctests(lines)
        lines = [re.sub(r"(\S)::\s*$", r"\1:", line) if not _PROMPT.match(line) else line for line in lines]
        return "\n".join(lines)

    def _roles(self, text: str, obj: griffe.Object) -> str:
        def link(m: re.Match) -> str:
            short, name = m.group(1) == "~", m.group(2)
            shown = name.split(".")[-1] if short else name
            target = self._resolve(name, obj)
            return f"[`{shown}`][{target}]" if target else f"`{shown}`"

        return _ROLE.sub(link, text)

    @staticmethod
    def _next_nonblank(lines: list[str], i: int) -> str | None:
        for line in lines[i + 1 :]:
            if line.strip():
                return line
        return None

    def _example_headers(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        for i, line in enumerate(lines):
            m = _EXAMPLE_HEADER.match(line)
            following = self._next_nonblank(lines, i)
            if m and following is not None and _PROMPT.match(following):
                indent = m.group("indent")
                if m.group("words"):
                    words = m.group("words").strip()
                    out += [f"{indent}{words[0].upper()}{words[1:]}:", ""]
                out.append(f"{indent}Examples:")
            else:
                out.append(line)
        return out

    @staticmethod
    def _fence_free_doctests(lines: list[str]) -> list[str]:
        """Wraps doctest runs that are not inside an ``Examples:`` section in fences."""
        out: list[str] = []
        section_indent: int | None = None  # indentation of the current Examples: header
        i = 0
        while i < len(lines):
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if line.strip():
                if line.strip() == "Examples:":
                    section_indent = indent
                elif section_indent is not None and indent <= section_indent:
                    section_indent = None
            m = _PROMPT.match(line)
            if m and section_indent is None:
                start_indent = m.group("indent")
                run = []
                while i < len(lines) and lines[i].strip() and lines[i].startswith(start_indent):
                    run.append(lines[i])
                    i += 1
                if out and out[-1].strip():
                    out.append("")
                out += [f"{start_indent}```pycon", *run, f"{start_indent}```", ""]
                continue
            out.append(line)
            i += 1
        return out

    @staticmethod
    def _walk(obj: griffe.Object):
        yield obj
        for member in obj.members.values():
            if member.is_alias:
                continue
            yield from DocstringMarkup._walk(member)
