"""vLLM's own scheduler and prefix-caching tests ("the peer suite"), run on CPU against the
installed vLLM wheel: once with vLLM's own KV-cache manager ("stock"), and once more with a
substitute manager or kvproof's checks. docs/vllm.md, "vLLM's own tests", has the counts.

    python tools/peer_suite.py                              # stock only, the two default files
    python tools/peer_suite.py --checks cheap               # stock, and stock with kvproof's checks
    python tools/peer_suite.py --manager-class pkg.mod:Cls  # stock, and Cls in the Scheduler
    python tools/peer_suite.py -k prefix --table /tmp/prefix.md     # a subset, per-test table

vLLM's tests are not part of kvproof: they come from vLLM's release sdist, fetched with pip into
a cache folder (``--cache``, default ``$KVPROOF_PEER_CACHE`` or ``~/.cache/kvproof/peer-suite``)
at the first run, or copied from an unpacked sdist (``--sdist DIR``). The sdist's commit must be
the installed wheel's. The suite's extra packages (requirements/peer-suite.txt) are installed
into the cache too, and put on the test run's path only.

How the environment is made to fit, without editing a test:
* models: every Hugging Face model id the tests name gets a tiny local stand-in in a hub cache
  (peer_suite_models.py); ``HF_HUB_OFFLINE=1``;
* ``VLLM_TARGET_DEVICE=cpu`` (vLLM then picks its V1 model runner: no Triton driver is active);
* torchvision's CUDA build next to the CPU torch: peer_suite_site/sitecustomize.py.

The substitute goes where the Scheduler builds its manager (peer_suite_plugin.py); with
``--substitute all`` also where tests build one themselves. Exit status: 0 ran (whatever the
tests did), 1 the results differ from ``--expect``, 2 bad input or the suite could not run.
"""

from __future__ import annotations

import argparse
import ast
import collections
import glob
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import peer_suite_models  # noqa: E402

VLLM_VERSION = "0.33.0"
VLLM_COMMIT = "g4ba787ec9"
DEFAULT_FILES = ("tests/v1/core/test_scheduler.py", "tests/v1/core/test_prefix_caching.py")
# kvproof's manager as vLLM's KVCacheManager (`--manager kvproof`).
KVPROOF_MANAGER = "kvproof.integrations.vllm.kvproof_manager:KvproofKVCacheManager"
OUTCOMES = ("pass", "fail", "error", "skip", "xfail", "xpass", "missing")

# Names of vLLM's KV-cache internals: its block objects and block pool, its coordinator and
# per-type managers. A test "reads vLLM internals" when it uses one of them that vLLM's own code
# does not use of its manager (integrations/vllm/manager_surface.py: a stand-in must offer
# those anyway): see ``internal_names``.
VLLM_INTERNALS = frozenset({
    # block objects (KVCacheBlock) and the lists of them in KVCacheBlocks
    "KVCacheBlock", "blocks", "block_id", "ref_cnt", "block_hash", "is_null", "null_block",
    # the block pool and its free queue and hash map
    "BlockPool", "FreeKVCacheBlockQueue", "BlockHashToBlockMap", "block_pool", "free_block_queue",
    "cached_block_hash_to_block", "get_cached_block", "get_one_block", "get_new_blocks", "free_blocks",
    "get_num_free_blocks", "num_free_blocks", "get_all_free_blocks", "fake_free_list_head",
    "fake_free_list_tail", "next_free_block", "prev_free_block", "evict_blocks", "cache_full_blocks",
    "_maybe_evict_cached_block",
    # the coordinator and the per-type managers
    "coordinator", "single_type_managers", "req_to_blocks", "num_cached_block", "hot_managers",
    "host_manager", "resident_managers", "get_kv_cache_coordinator", "HybridKVCacheCoordinator",
    "UnitaryKVCacheCoordinator", "KVCacheCoordinatorNoPrefixCache", "FullAttentionManager",
    "SlidingWindowManager", "ChunkedLocalAttentionManager", "MambaManager", "CrossAttentionManager",
})


def internal_names() -> frozenset:
    from kvproof.integrations.vllm.manager_surface import SURFACE

    return VLLM_INTERNALS - {part for use in SURFACE for part in use.path}


class SuiteError(Exception):
    """The suite could not be prepared or run (exit status 2)."""


def default_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("KVPROOF_PEER_CACHE") or os.path.join(base, "kvproof", "peer-suite")


def _commit_of(version_file: str) -> tuple[str, str]:
    scope: dict = {}
    with open(version_file, encoding="utf-8") as f:
        exec(f.read(), scope)  # vLLM's own two-line vllm/_version.py
    return scope["__version__"], scope["__commit_id__"]


def _install_suite(sdist_root: str, suite: str) -> None:
    """Copies what the run needs of an unpacked sdist into ``suite``: ``tests/``, the pytest
    configuration (vLLM's pyproject.toml: its markers) and ``vllm/_version.py``. Never vLLM's own
    ``vllm/`` folder: pytest would put the folder above ``tests/`` on sys.path, and the sdist's
    unbuilt source would shadow the installed wheel."""
    version_file = os.path.join(sdist_root, "vllm", "_version.py")
    if not os.path.isfile(version_file) or not os.path.isdir(os.path.join(sdist_root, "tests", "v1", "core")):
        raise SuiteError(f"--sdist {sdist_root}: expected an unpacked vLLM sdist (vllm/_version.py, tests/v1/core/)")
    version, commit = _commit_of(version_file)
    if (version, commit) != (VLLM_VERSION, VLLM_COMMIT):
        raise SuiteError(f"{sdist_root} is vLLM {version} ({commit}); the suite runs {VLLM_VERSION} ({VLLM_COMMIT})")
    staging = tempfile.mkdtemp(prefix="suite-", dir=os.path.dirname(suite))
    shutil.copytree(os.path.join(sdist_root, "tests"), os.path.join(staging, "tests"))
    shutil.copy(os.path.join(sdist_root, "pyproject.toml"), staging)
    shutil.copy(version_file, staging)
    shutil.rmtree(suite, ignore_errors=True)
    os.rename(staging, suite)  # whole or not at all


def fetch_sdist(work: str) -> str:
    """Mutates ``work``: downloads vLLM's release sdist with pip and returns the unpacked tree,
    inside ``work``. pip unpacks the sdist, then fails to build it; ``--no-clean`` keeps the
    tree, and ``--no-build-isolation`` makes the build fail at once instead of first installing
    vLLM's build requirements (a CUDA torch)."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-clean",
        "--no-build-isolation", f"vllm=={VLLM_VERSION}", "-d", os.path.join(work, "download"),
    ]
    print(f"fetching vLLM {VLLM_VERSION}'s sdist ...", file=sys.stderr)
    result = subprocess.run(command, env=dict(os.environ, TMPDIR=work), capture_output=True, text=True)
    found = glob.glob(os.path.join(work, "pip-*", "vllm_*", "PKG-INFO"))
    if not found:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-5:])
        raise SuiteError(f"pip did not unpack vLLM {VLLM_VERSION}'s sdist:\n{tail}")
    return os.path.dirname(found[0])


def prepare(cache: str, sdist: str | None, refresh: bool) -> str:
    """Mutates ``cache``: the suite folder (vLLM's tests) and the tiny models' hub cache.
    Returns the suite folder."""
    os.makedirs(cache, exist_ok=True)
    suite = os.path.join(cache, f"vllm-{VLLM_VERSION}")
    if sdist is not None:
        _install_suite(sdist, suite)
    elif refresh or not os.path.isfile(os.path.join(suite, "_version.py")):
        with tempfile.TemporaryDirectory(prefix="fetch-", dir=cache) as work:
            _install_suite(fetch_sdist(work), suite)
    peer_suite_models.write_hub_cache(os.path.join(cache, "hf"))
    return suite


def check_installed_vllm() -> None:
    try:
        from vllm import _version
    except ImportError as e:
        raise SuiteError(f"vLLM is not installed ({e}); see requirements/vllm.txt") from None
    if (_version.__version__, _version.__commit_id__) != (VLLM_VERSION, VLLM_COMMIT):
        raise SuiteError(
            f"installed vLLM is {_version.__version__} ({_version.__commit_id__}); the suite runs "
            f"{VLLM_VERSION} ({VLLM_COMMIT})"
        )


REQUIREMENTS = os.path.join(os.path.dirname(HERE), "requirements", "peer-suite.txt")


def install_deps(cache: str) -> str:
    """Mutates ``cache``: installs requirements/peer-suite.txt into ``cache/deps`` (once per
    version of that file) and returns the folder, which only the test run gets on its path."""
    target = os.path.join(cache, "deps")
    with open(REQUIREMENTS, "rb") as f:
        stamp = hashlib.sha1(f.read()).hexdigest()
    stamp_file = os.path.join(target, ".requirements-sha1")
    if os.path.isfile(stamp_file) and open(stamp_file, encoding="utf-8").read() == stamp:
        return target
    print(f"installing requirements/peer-suite.txt into {target} ...", file=sys.stderr)
    shutil.rmtree(target, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, "-r", REQUIREMENTS]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-5:])
        raise SuiteError(f"could not install requirements/peer-suite.txt:\n{tail}")
    with open(stamp_file, "w", encoding="utf-8") as f:
        f.write(stamp)
    return target


def run_pytest(suite: str, cache: str, deps: str, files, keyword, variant: dict, jobs: int, timeout: float) -> dict:
    """Runs ``files`` of the suite in a pytest subprocess; returns ``{node id: record}`` (outcome,
    reason, builds) for every collected test, ``missing`` for one that never reported."""
    fd, report = tempfile.mkstemp(prefix="report-", suffix=".jsonl", dir=cache)
    os.close(fd)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROOF_")}
    env.update(
        VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
        HF_HOME=os.path.join(cache, "hf"), VLLM_CACHE_ROOT=os.path.join(cache, "vllm-cache"),
        PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(HERE, "peer_suite_site"), HERE, deps, env.get("PYTHONPATH")])),
        KVPROOF_PEER_REPORT=report, **variant,
    )
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "peer_suite_plugin", "-q",
               "--rootdir", suite, "-o", "addopts=", "--tb=no", "-W", "ignore::DeprecationWarning"]
    if keyword:
        command += ["-k", keyword]
    if jobs > 1:
        command += ["-n", str(jobs)]
    command += list(files)
    try:
        result = subprocess.run(command, cwd=suite, env=env, capture_output=True, text=True, timeout=timeout)
        with open(report, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except subprocess.TimeoutExpired:
        raise SuiteError(f"the suite ran past {timeout:.0f} s") from None
    finally:
        os.unlink(report)
    # Every process that collects writes its list (pytest-xdist: each worker; the controller's is empty).
    collected = max((line["collected"] for line in lines if "collected" in line), key=len, default=None)
    if collected is None or result.returncode not in (0, 1):
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise SuiteError(f"pytest exited {result.returncode} in {suite}:\n{tail}")
    records = {line["test"]: line for line in lines if "test" in line}
    return {test: records.get(test, {"test": test, "outcome": "missing", "reason": "never reported", "builds": []})
            for test in collected}


def internal_reads(suite: str, files) -> dict[str, list[str]]:
    """``{file::function: names}``: the names of ``internal_names()`` each test function reads,
    in its body, in the fixtures it takes and in the module's functions it calls (transitively)."""
    internal = internal_names()
    out = {}
    for path in files:
        with open(os.path.join(suite, path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                    functions[f"{cls.name}::{node.name}"] = node
        for name, node in functions.items():
            if name.split("::")[-1].startswith("test"):
                out[f"{path}::{name}"] = sorted(_names_reached(node, functions, internal))
    return out


def _names_reached(root, functions, internal) -> set[str]:
    seen, stack, names = set(), [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        followed = [arg.arg for arg in node.args.args]  # fixtures of the same module
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr in internal:
                names.add(sub.attr)
            elif isinstance(sub, ast.Name):
                if sub.id in internal:
                    names.add(sub.id)
                followed.append(sub.id)
        stack.extend(functions[name] for name in followed if name in functions)
    return names


def _function_of(test: str) -> str:
    return test.split("[", 1)[0]


def via(builds: list[str]) -> str:
    """How a test got its KV-cache manager: ``scheduler``, ``direct``, ``both``, or the internal
    object it built without a manager (``coordinator``, ``pool``), or ``none``."""
    kinds = set(builds)
    if {"scheduler", "direct"} <= kinds:
        return "both"
    for kind in ("scheduler", "direct", "coordinator", "pool"):
        if kind in kinds:
            return kind
    return "none"


def write_table(path: str, columns: dict[str, dict], internals: dict[str, list[str]], command: str) -> None:
    """Mutates the file system: a markdown table, one row per test (parsed back by ``read_table``);
    rows and ``via`` come from the first column."""
    first = next(iter(columns.values()))
    lines = [
        f"# vLLM {VLLM_VERSION}'s own tests, per test",
        "",
        f"Written by `{command}`; docs/vllm.md, \"vLLM's own tests\", has the counts.",
        "",
        "`via`: how the test got its KV-cache manager (`scheduler`: built by vLLM's Scheduler;",
        "`direct`: the test calls `KVCacheManager(...)`; `both`; `coordinator`/`pool`: it builds",
        "those internals without a manager; `none`: no KV-cache object). `internals`: what it reads",
        "of vLLM's block objects, block pool, coordinator or per-type managers.",
        "",
        "| test | via | internals | " + " | ".join(columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for test in first:
        cells = [columns[name].get(test, {}).get("outcome", "-") for name in columns]
        reads = ", ".join(internals.get(_function_of(test), [])) or "-"
        lines.append(f"| `{test}` | {via(first[test]['builds'])} | {reads} | " + " | ".join(cells) + " |")
    failing = [(name, test, columns[name][test]) for name in columns for test in columns[name]
               if columns[name][test]["outcome"] not in ("pass", "skip", "xfail")]
    if failing:
        lines += ["", "## Why each failing test fails", "", "| column | test | reason |", "|---|---|---|"]
        lines += [f"| {name} | `{test}` | {record['reason'].replace('|', '/')} |" for name, test, record in failing]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def read_table(path: str) -> dict[str, dict[str, str]]:
    """``{column: {test: outcome}}`` from a table ``write_table`` wrote."""
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("| ")]
    header = [cell.strip() for cell in rows[0].strip().strip("|").split("|")]
    out: dict[str, dict[str, str]] = {name: {} for name in header[3:]}
    for row in rows[1:]:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) != len(header) or not cells[0].startswith("`"):
            break  # the reasons table that follows
        for name, cell in zip(header[3:], cells[3:]):
            out[name][cells[0].strip("`")] = cell
    return out


def summary(columns: dict[str, dict], internals: dict[str, list[str]]) -> str:
    """Counts per column and outcome, overall and for the tests whose manager the Scheduler
    builds and that read no vLLM internals (the ones a substitute must pass); ``via`` from the
    first column."""
    first = next(iter(columns.values()))
    clean = [t for t in first if via(first[t]["builds"]) == "scheduler" and not internals.get(_function_of(t))]
    lines = [f"{len(first)} tests; by how they get a manager: "
             + ", ".join(f"{k} {v}" for k, v in collections.Counter(via(r["builds"]) for r in first.values()).most_common())
             + f"; {sum(bool(internals.get(_function_of(t))) for t in first)} read vLLM internals; "
             + f"{len(clean)} build through the Scheduler and read none"]
    for name, records in columns.items():
        for label, tests in (("all", list(records)), ("scheduler-built, no internals", clean)):
            counts = collections.Counter(records[t]["outcome"] for t in tests if t in records)
            lines.append(f"  {name:>14} {label:>30}: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES), help="test files, relative to the sdist root")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--sdist", help="an unpacked vLLM sdist to take the tests from (else pip fetches it)")
    parser.add_argument("--cache", default=default_cache(), help="where the tests, tiny models and reports live")
    parser.add_argument("--refresh", action="store_true", help="fetch the sdist again")
    parser.add_argument("--manager", choices=("stock", "kvproof"), default="stock",
                        help="the second column's manager: kvproof's (integrations/vllm/kvproof_manager.py)")
    parser.add_argument("--manager-class", help="module:Class, the second column's manager")
    parser.add_argument("--substitute", choices=("scheduler", "all"), default="scheduler",
                        help="where the manager is replaced: where the Scheduler builds it, or also in tests that build one")
    parser.add_argument("--checks", choices=("cheap", "slow"), help="kvproof's checks in the second column")
    parser.add_argument("--no-stock", action="store_true", help="skip the stock column")
    parser.add_argument("-n", "--jobs", type=int, default=1, help="pytest-xdist workers")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per pytest run")
    parser.add_argument("--table", help="write the per-test table (markdown) here")
    parser.add_argument("--json", help="write every record here")
    parser.add_argument("--expect", help="a table written earlier: exit 1 where a column's outcomes differ from it")
    args = parser.parse_args(argv)
    manager = args.manager_class or (KVPROOF_MANAGER if args.manager == "kvproof" else None)
    try:
        check_installed_vllm()
        if manager is not None:
            _check_importable(manager)
        cache = os.path.abspath(args.cache)
        suite = prepare(cache, args.sdist, args.refresh)
        deps = install_deps(cache)
        for path in args.files:
            if not os.path.isfile(os.path.join(suite, path)):
                raise SuiteError(f"{path}: no such test file in vLLM {VLLM_VERSION}'s sdist")
        for model_id, path in peer_suite_models.unknown_model_ids([os.path.join(suite, p) for p in args.files]):
            print(f"warning: {path} names {model_id!r}, which has no tiny stand-in", file=sys.stderr)
        variants = {} if args.no_stock else {"stock": {}}
        if manager is not None or args.checks:
            name = (args.manager if args.manager_class is None else manager.rsplit(":", 1)[-1]) + (f"+{args.checks}" if args.checks else "")
            variant = {"KVPROOF_PEER_SUBSTITUTE": args.substitute}
            if manager is not None:
                variant["KVPROOF_PEER_MANAGER"] = manager
            if args.checks:
                variant["KVPROOF_CONTRACTS"] = args.checks
            variants[name] = variant
        if not variants:
            raise SuiteError("--no-stock leaves nothing to run: add --manager, --manager-class or --checks")
        columns = {}
        for name, variant in variants.items():
            print(f"running {len(args.files)} file(s), {name} ...", file=sys.stderr)
            columns[name] = run_pytest(suite, cache, deps, args.files, args.keyword, variant, args.jobs, args.timeout)
    except SuiteError as e:
        print(f"peer_suite: {e}", file=sys.stderr)
        return 2
    internals = internal_reads(suite, args.files)
    print(summary(columns, internals))
    command = shlex.join(["python", "tools/peer_suite.py", *(argv if argv is not None else sys.argv[1:])])
    if args.table:
        write_table(args.table, columns, internals, command)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"columns": columns, "internals": internals}, f, indent=1)
    if args.expect:
        return _compare(read_table(args.expect), columns)
    return 0


def _check_importable(spec: str) -> None:
    import importlib

    module_name, _, class_name = spec.partition(":")
    try:
        getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise SuiteError(f"manager {spec!r} cannot be imported: {e}") from None


def _compare(expected: dict[str, dict[str, str]], columns: dict[str, dict]) -> int:
    differences = []
    for name, records in columns.items():
        if name not in expected:
            continue
        for test, record in records.items():
            want = expected[name].get(test)
            if want != record["outcome"]:
                differences.append(f"{name} {test}: {record['outcome']} ({record['reason']}), recorded {want}")
    for line in differences:
        print(line)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
