"""What the docs name exists: every repository path, ``kvproof`` module (and attribute), file and
name reference (``impl/coordinator.py:HybridCoordinator``) and code identifier named in docs/,
the READMEs and the docstrings and comments of every Python file; and docs/vllm-semantics.md's
citations of vLLM 0.33.0.

Strict but not flaky: the checks read files only (nothing is imported, no network), names are
matched as whole words, and a name counts as existing when kvproof's code defines or uses it
(an AST walk), when the installed vLLM's source has it, or when it is a Python builtin.
"""

from __future__ import annotations

import ast
import builtins
import io
import keyword
import re
import subprocess
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEMANTICS = ROOT / "docs" / "vllm-semantics.md"

TOP = r"(?:spec|impl|sim|oracle|kernels|proofs|e2e|planner|integrations|cli|tests|benchmarks|docs|tools|examples|requirements|kvproof|\.ci)"
PATH = re.compile(rf"(?<![\w./~-]){TOP}/[\w.*/-]*[\w*](?![\w<{{])")
MODULE = re.compile(r"(?<![\w.])kvproof(?:\.[A-Za-z_]\w*)+")
FILE_NAME = re.compile(r"(?<![\w./-])([\w/]+\.py):([A-Za-z_]\w*)")
INLINE = re.compile(r"``?([^`\n]+?)``?")
IDENTIFIER = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?$")
#: Paths that name vLLM's own test tree (in its release sdist, docs/vllm.md), not ours.
FOREIGN = ("tests/v1/", "tests/distributed/")
#: Backticked words that look like code but name no code: notation and other programs' names.
NOT_CODE = {
    "B_g", "bs_g",  # a group's block sizes in formulas (docs/geometry.md)
    "CrossHair",  # the tool (the package is crosshair)
    "NotDeterministic",  # a CrossHair verdict
    "MemAvailable",  # a field of /proc/meminfo
    "sun_path",  # the socket address field of sockaddr_un (its length limit)
}
#: docs/vllm-semantics.md names vLLM's own tests (in its release sdist, not installed).
#: Docs that name vLLM's own tests (test_... names that are not kvproof's).
VLLM_TESTS_DOCS = ("docs/vllm-semantics.md", "docs/vllm.md")


@lru_cache(maxsize=None)
def repo_files() -> tuple[Path, ...]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return tuple(ROOT / p for p in sorted(set(out.split("\0"))) if p and (ROOT / p).is_file())


def text_files() -> list[Path]:
    return [p for p in repo_files() if p.suffix in (".md", ".py", ".txt", ".toml") or p.name == "run"]


def prose_of(path: Path) -> str:
    """What a reader reads: a Markdown file whole; a Python file's docstrings and comments."""
    text = path.read_text(errors="replace")
    if path.suffix != ".py":
        return text
    parts = []
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            parts.append(node.value.value)  # attribute docstrings (a string after an assignment)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            parts.append(tok.string)
    return "\n".join(parts)


def documents() -> list[Path]:
    """docs/, every README and every Python file (tests, benchmarks and tools included)."""
    return [p for p in repo_files() if p.suffix == ".py" or (p.suffix == ".md" and (p.parent.name == "docs" or p.name == "README.md"))]


def _outside_fences(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _package_folder(module: str) -> Path:
    """A module's path without its suffix, by setup.py's map: a top folder installs as the
    sub-package of its name (``kvproof.spec.layout`` is spec/layout.py), and ``kvproof.extras`` is
    kvproof/extras.py, in the root package's own folder."""
    parts = module.split(".")
    if len(parts) == 1:
        return ROOT / "kvproof"
    own = ROOT.joinpath("kvproof", *parts[1:])
    return own if own.with_suffix(".py").is_file() else ROOT.joinpath(*parts[1:])


def resolve_module(dotted: str) -> str | None:
    """None if ``dotted`` names a module of the tree, or a module and then names it defines;
    else what is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        folder = _package_folder(".".join(parts[:cut]))
        source = folder / "__init__.py" if folder.is_dir() else folder.with_suffix(".py")
        if source.is_file():
            rest = parts[cut:]
            if not rest:
                return None
            if rest[0] not in defined_in(source):
                return f"{'.'.join(parts[:cut])} defines no {rest[0]!r}"
            return None
    return f"no module {dotted}"


@lru_cache(maxsize=None)
def defined_in(source: Path) -> frozenset[str]:
    """Names a module defines at any level (functions, classes, assignments, imports, attributes)."""
    tree = ast.parse(source.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


@lru_cache(maxsize=None)
def code_names() -> frozenset[str]:
    """Every name kvproof's Python code defines or uses (not its comments or docstrings)."""
    names = set(dir(builtins)) | set(keyword.kwlist)
    for p in repo_files():
        if p.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.update((node.asname or node.name).split("."))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)  # dict keys, getattr names, JSON fields
    return frozenset(names)


@lru_cache(maxsize=None)
def vllm_names() -> frozenset[str]:
    """Every word in the installed vLLM's source (empty without vLLM)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return frozenset()
    if spec is None or not spec.origin:
        return frozenset()
    words = set()
    for p in Path(spec.origin).parent.rglob("*.py"):
        words.update(re.findall(r"[A-Za-z_]\w*", p.read_text(errors="replace")))
    return frozenset(words)


def _candidates(pattern: re.Pattern, texts) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for where, text in texts:
        for m in pattern.finditer(text):
            found.setdefault(m.group(0), []).append(where)
    return found


@lru_cache(maxsize=None)
def _texts() -> tuple[tuple[str, str], ...]:
    return tuple((str(p.relative_to(ROOT)), prose_of(p)) for p in documents())


def test_every_repository_path_named_exists():
    missing = {}
    for token, where in _candidates(PATH, _texts()).items():
        token = token.rstrip(".")
        if token.startswith(FOREIGN):
            continue
        exists = any(ROOT.glob(token)) if "*" in token else (ROOT / token).exists()
        if not exists:
            missing[token] = sorted(set(where))
    assert len(_candidates(PATH, _texts())) > 100  # the docs name paths throughout
    assert not missing, "\n".join(f"{k}: {v}" for k, v in sorted(missing.items()))


def test_every_kvproof_module_named_exists():
    missing = {}
    found = _candidates(MODULE, _texts())
    for dotted, where in found.items():
        why = resolve_module(dotted)
        if why:
            missing[dotted] = (why, sorted(set(where)))
    assert len(found) > 50
    assert not missing, "\n".join(f"{k}: {v}" for k, v in sorted(missing.items()))


def test_every_file_and_name_reference_exists():
    """A file and name reference: the file exists and defines the name."""
    missing = {}
    for where, text in _texts():
        for path, name in FILE_NAME.findall(text):
            source = ROOT / path
            if not source.is_file():
                candidates = [p for p in repo_files() if p.name == Path(path).name]
                if len(candidates) != 1:
                    missing[f"{path}:{name}"] = f"{where}: no such file"
                    continue
                source = candidates[0]
            if name not in defined_in(source):
                missing[f"{path}:{name}"] = f"{where}: {source.relative_to(ROOT)} defines no {name!r}"
    assert not missing, "\n".join(f"{k}: {v}" for k, v in sorted(missing.items()))


@pytest.mark.vllm
def test_every_code_identifier_named_exists():
    """Backticked identifiers that can only be code (a dot, an underscore, CamelCase or a call)
    name something kvproof's code or the installed vLLM has."""
    pytest.importorskip("vllm")
    known = code_names() | vllm_names() | NOT_CODE | {f.stem for f in repo_files()}
    file_names = {f.name for f in repo_files()}
    missing = {}
    checked = 0
    for where, text in _texts():
        text = _outside_fences(text) if where.endswith(".md") else text
        for m in INLINE.finditer(text):
            token = m.group(1).strip()
            if not IDENTIFIER.match(token):
                continue
            bare = token.removesuffix("()")
            parts = bare.split(".")
            if not (len(parts) > 1 or "_" in bare.strip("_") or re.search(r"[a-z][A-Z]", bare) or token.endswith("()")):
                continue  # an ordinary word
            if parts[0] == "kvproof":
                continue  # a module: test_every_kvproof_module_named_exists
            if where in VLLM_TESTS_DOCS and bare.startswith("test_"):
                continue
            if re.search(r"\.(py|jsonl|c|toml|md)$", bare):  # a file named by its name alone
                checked += 1
                if bare not in file_names:
                    missing.setdefault(token, set()).add(where)
                continue
            checked += 1
            absent = [p for p in parts if p not in known]
            if absent:
                missing.setdefault(token, set()).add(where)
    assert checked > 300
    assert not missing, "\n".join(f"{k}: {sorted(v)}" for k, v in sorted(missing.items()))


OUTSIDE = re.compile(r"\b(?:[Rr]eference(?:'s)? (?:section )?§?\d+(?:\.\d+)?|[Ii]ssues? #?\d+|vllm-0\.33-kv-semantics)")


def test_nothing_cites_material_outside_the_repository():
    """A reader has docs/vllm-semantics.md, not the reference it was written from, nor the
    tracker: a section number of that reference, or an issue number, tells them nothing."""
    found = {}
    for where, text in _texts():
        for m in OUTSIDE.finditer(text):
            found.setdefault(m.group(0), set()).add(where)
    assert not found, "\n".join(f"{k}: {sorted(v)}" for k, v in sorted(found.items()))


# --- docs/vllm-semantics.md ---------------------------------------------------------------------

CITATION = re.compile(r"`((?:v1|config|model_executor|platforms|utils|engine)/[\w/.]+\.py):(\d+)(?:-(\d+))?` \(`([^`]+)`\)")
SECTION_CITED = re.compile(r"vllm-semantics(?:\.md)? ((?:§\d+(?:\.\d+)?(?:, | and )?)+)")
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?) ", re.M)


def test_the_semantics_page_cites_vllm_throughout():
    assert len(CITATION.findall(SEMANTICS.read_text())) >= 40


@pytest.mark.vllm
def test_every_citation_names_what_the_installed_vllm_has_at_those_lines():
    vllm = pytest.importorskip("vllm")
    assert vllm.__version__ == "0.33.0", vllm.__version__
    root = Path(vllm.__file__).parent
    wrong = []
    for path, first, last, name in CITATION.findall(SEMANTICS.read_text()):
        source = root / path
        if not source.is_file():
            wrong.append(f"{path}: no such file in vLLM {vllm.__version__}")
            continue
        lines = source.read_text().splitlines()[int(first) - 1: int(last or first)]
        if not any(name in line for line in lines):
            wrong.append(f"{path}:{first}-{last or first}: {name!r} not there")
    assert not wrong, "\n".join(wrong)


def test_every_section_cited_in_the_repository_exists():
    sections = set(HEADING.findall(SEMANTICS.read_text()))
    cited: dict[str, list[str]] = {}
    for path in text_files():
        for numbers in SECTION_CITED.findall(path.read_text(errors="replace")):
            for number in re.findall(r"§(\d+(?:\.\d+)?)", numbers):
                cited.setdefault(number, []).append(str(path.relative_to(ROOT)))
    assert len(cited) >= 10  # the code and docs cite the page
    missing = {n: sorted(set(where)) for n, where in cited.items() if n not in sections}
    assert not missing, "\n".join(f"{k}: {v}" for k, v in sorted(missing.items()))
