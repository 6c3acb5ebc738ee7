"""What vLLM 0.33.0 uses of its KV-cache manager: every method its code calls on the
Scheduler's ``kv_cache_manager`` (with the keyword arguments it passes), every attribute it
reads, down through the objects it reaches that way (``coordinator``, ``block_pool``,
``coordinator.single_type_managers[*]``, ...). A manager that stands in for vLLM's
``KVCacheManager`` must offer all of it (docs/vllm-manager-surface.md says what each use expects
back); ``missing_from(candidate)`` lists what a candidate lacks.

``SURFACE`` is the checked-in list for vLLM 0.33.0 (``__init__``: the keyword arguments the
Scheduler builds its manager with). ``extract()`` reads the installed vLLM's
source with ``ast`` and derives the same list; tests/vllm/test_manager_surface.py compares the
two, so an upgrade that calls something new fails naming it.

How ``extract`` finds the manager in vLLM's code: an attribute named ``kv_cache_manager`` or
``_kv_cache_manager`` (``self.kv_cache_manager``, ``scheduler.kv_cache_manager``,
``getattr(self.scheduler, "kv_cache_manager", None)``), a parameter named ``kv_cache_manager``
(the connectors and helpers the Scheduler hands it to), and what is bound from those: local
names, ``self`` attributes of the same class, loop variables over them (``[*]`` in a path).
Return values are not followed: what vLLM does with them is the document's part. Nor is an
object handed on to a function under another name (the connectors' ``bind_gpu_block_pool``):
the document lists those hand-offs.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
from typing import Iterable, Optional

MANAGER_NAMES = frozenset({"kv_cache_manager", "_kv_cache_manager"})

# Where a use sits: the Scheduler itself, the engine core around it, or a KV connector / the
# components only a connector configuration builds (KV offloading, HiSparse, aux outputs).
CONTEXTS = ("scheduler", "engine", "connector")


def context_of(relative_path: str) -> str:
    if relative_path.startswith("v1/core/sched/"):
        return "scheduler"
    if relative_path.startswith("v1/engine/"):
        return "engine"
    return "connector"


@dataclasses.dataclass(frozen=True)
class Use:
    """One thing vLLM uses of the manager. ``path``: attribute names from the manager, ``[*]``
    for an element (iterated or indexed). ``kind``: ``call`` (a method called with up to
    ``positional`` positional arguments and the ``keywords``), ``read`` (read, or passed on,
    not called here), ``optional`` (read through ``getattr`` with a default or ``hasattr``: may
    be absent), ``write`` (assigned). ``contexts``: where (see ``CONTEXTS``)."""

    path: tuple[str, ...]
    kind: str
    contexts: tuple[str, ...]
    positional: int = 0
    keywords: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return ".".join(self.path).replace(".[*]", "[*]")


def _use(path: str, kind: str, contexts: str, positional: int = 0, keywords: str = "") -> Use:
    parts = tuple(part for piece in path.split(".") for part in _split_star(piece))
    return Use(parts, kind, tuple(contexts.split()), positional, tuple(keywords.split()))


def _split_star(piece: str) -> tuple[str, ...]:
    return (piece[:-3], "[*]") if piece.endswith("[*]") else (piece,)


# vLLM 0.33.0 (g4ba787ec9). Regenerate with `python -m kvproof.integrations.vllm.manager_surface`.
SURFACE: tuple[Use, ...] = (
    _use('__init__', 'call', 'scheduler', 0, 'dcp_world_size enable_caching enable_kv_cache_events enable_mamba_shared_prefix_checkpoint hash_block_size kv_cache_config log_stats max_in_flight_tokens max_model_len metrics_collector num_hash_lookahead_tokens num_prefill_lookahead pcp_world_size scheduler_block_size use_eagle watermark'),
    _use('allocate_slots', 'call', 'scheduler', 2, 'delay_cache_blocks full_sequence_must_fit has_scheduled_reqs new_computed_blocks num_encoder_tokens num_external_computed_tokens num_lookahead_tokens num_new_computed_tokens reserved_blocks skip_zeroing_group_ids'),
    _use('block_pool', 'read', 'scheduler connector'),
    _use('block_pool.free_blocks', 'call', 'scheduler', 1),
    _use('block_pool.hash_block_size', 'read', 'connector'),
    _use('cache_blocks', 'call', 'scheduler', 2),
    _use('coordinator', 'read', 'scheduler engine connector'),
    _use('coordinator.enable_partial_hash_hits', 'read', 'scheduler'),
    _use('coordinator.find_longest_cache_hit_per_group', 'call', 'connector', 2),
    _use('coordinator.full_attention_group_id', 'optional', 'connector'),
    _use('coordinator.get_num_blocks_to_allocate', 'call', 'scheduler', 0, 'apply_admission_cap new_computed_blocks num_encoder_tokens num_local_computed_tokens num_tokens num_tokens_main_model prefill_end request_id total_computed_tokens'),
    _use('coordinator.num_reprefillable_tokens', 'read', 'connector'),
    _use('coordinator.single_type_managers', 'read', 'scheduler engine connector'),
    _use('coordinator.single_type_managers[*]', 'read', 'scheduler engine connector'),
    _use('coordinator.single_type_managers[*].block_pool', 'read', 'connector'),
    _use('coordinator.single_type_managers[*].block_pool.get_cached_block', 'call', 'connector', 2),
    _use('coordinator.single_type_managers[*].block_size', 'read', 'scheduler engine connector'),
    _use('coordinator.single_type_managers[*].kv_cache_spec', 'read', 'scheduler engine'),
    _use('empty_kv_cache_blocks', 'read', 'scheduler'),
    _use('empty_kv_cache_blocks.blocks', 'read', 'scheduler'),
    _use('estimate_cached_tokens', 'call', 'scheduler', 1),
    _use('evict_blocks', 'call', 'scheduler', 1),
    _use('finalize_partial_tail_offloads', 'call', 'scheduler', 1),
    _use('free', 'call', 'scheduler', 1),
    _use('get_block_ids', 'call', 'scheduler', 1),
    _use('get_block_ids_for_computed_tokens', 'call', 'scheduler', 0, 'num_computed_tokens request_id'),
    _use('get_blocks', 'call', 'scheduler', 1),
    _use('get_computed_blocks', 'call', 'scheduler', 2),
    _use('get_computed_blocks_for_connector', 'call', 'scheduler', 2),
    _use('kv_cache_config', 'read', 'connector'),
    _use('kv_cache_config.num_blocks', 'read', 'connector'),
    _use('make_prefix_cache_stats', 'call', 'scheduler'),
    _use('mamba_shared_prefix_checkpoint', 'read', 'scheduler'),
    _use('max_model_len', 'read', 'connector'),
    _use('new_step_starts', 'call', 'scheduler'),
    _use('pop_blocks_for_free', 'call', 'scheduler', 1),
    _use('record_blocks_for_zeroing', 'call', 'scheduler', 2),
    _use('record_prefix_cache_stats', 'call', 'scheduler', 2),
    _use('remove_skipped_blocks', 'call', 'scheduler', 0, 'num_prompt_tokens processed_computed_tokens request_id'),
    _use('reset_prefix_cache', 'call', 'scheduler'),
    _use('take_boundary_state_offloads', 'call', 'scheduler'),
    _use('take_events', 'call', 'scheduler'),
    _use('take_kv_cache_block_copies', 'call', 'scheduler'),
    _use('take_new_block_ids', 'call', 'scheduler'),
    _use('truncate_computed_blocks', 'call', 'scheduler', 2),
    _use('usage', 'read', 'scheduler'),
)


@dataclasses.dataclass
class _Found:
    kinds: set
    contexts: set
    positional: int
    keywords: set
    sites: list


def extract(vllm_root: Optional[str] = None) -> tuple[tuple[Use, ...], dict[str, list[str]]]:
    """Reads the vLLM source under ``vllm_root`` (default: the installed package). Returns the
    uses, sorted by path, and ``{use name: ["file:line", ...]}``, the call sites."""
    if vllm_root is None:
        import vllm

        vllm_root = os.path.dirname(vllm.__file__)
    found: dict[tuple[str, ...], _Found] = {}
    for directory, _, files in sorted(os.walk(vllm_root)):
        for file_name in sorted(files):
            if not file_name.endswith(".py"):
                continue
            path = os.path.join(directory, file_name)
            with open(path, encoding="utf-8") as f:
                source = f.read()
            if "kv_cache_manager" not in source:
                continue
            relative = os.path.relpath(path, vllm_root).replace(os.sep, "/")
            _Module(relative, found).visit(ast.parse(source))
    uses, sites = [], {}
    for path, item in sorted(found.items()):
        kind = next(k for k in ("call", "write", "read", "optional") if k in item.kinds)
        use = Use(path, kind, tuple(c for c in CONTEXTS if c in item.contexts),
                  item.positional if kind == "call" else 0, tuple(sorted(item.keywords)) if kind == "call" else ())
        uses.append(use)
        sites[use.name] = item.sites
    return tuple(uses), sites


class _Module(ast.NodeVisitor):
    """Records the uses in one module: each function is read with its own names and the
    ``self`` attributes its class binds to the manager or to something reached from it."""

    def __init__(self, relative: str, found: dict) -> None:
        self.relative = relative
        self.context = context_of(relative)
        self.found = found

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        self_aliases: dict[str, tuple] = {}
        for _ in range(3):  # an alias of an alias: settle in a few passes
            for method in methods:
                env = self._env(method, self_aliases)
                for sub in ast.walk(method):
                    if isinstance(sub, ast.Assign):
                        for target in sub.targets:
                            if _is_self_attr(target) and target.attr not in MANAGER_NAMES:
                                path = _path(sub.value, env, self_aliases)
                                if path is not None:
                                    self_aliases[target.attr] = path
        for method in methods:
            self._record(method, self_aliases)
        for other in node.body:
            if not isinstance(other, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.visit(other)

    def visit_FunctionDef(self, node) -> None:  # module-level functions (methods: visit_ClassDef)
        self._record(node, {})

    visit_AsyncFunctionDef = visit_FunctionDef

    def _env(self, function, self_aliases) -> dict[str, tuple]:
        args = function.args
        env = {a.arg: () for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg == "kv_cache_manager"}
        for _ in range(3):
            for sub in ast.walk(function):
                if isinstance(sub, ast.Assign):
                    path = _path(sub.value, env, self_aliases)
                    if path is not None:
                        for target in sub.targets:
                            if isinstance(target, ast.Name):
                                env[target.id] = path
                elif isinstance(sub, (ast.For, ast.AsyncFor, ast.comprehension)):
                    for name, iterated in _loop_bindings(sub.target, sub.iter):
                        path = _path(iterated, env, self_aliases)
                        if path is not None:
                            env[name] = path + ("[*]",)
        return env

    def _record(self, function, self_aliases) -> None:
        env = self._env(function, self_aliases)
        calls = {id(n.func): n for n in ast.walk(function) if isinstance(n, ast.Call)}
        for sub in ast.walk(function):
            if isinstance(sub, ast.Attribute) and sub.attr not in MANAGER_NAMES:
                base = _path(sub.value, env, self_aliases)
                if base is None:
                    continue
                call = calls.get(id(sub))
                if call is not None:
                    self._add(base + (sub.attr,), "call", sub, call)
                else:
                    self._add(base + (sub.attr,), "write" if isinstance(sub.ctx, ast.Store) else "read", sub)
            elif isinstance(sub, ast.Call) and _constructs_manager(sub):
                self._add(("__init__",), "call", sub, sub)
            elif isinstance(sub, ast.Subscript):
                base = _path(sub.value, env, self_aliases)
                if base is not None:
                    self._add(base + ("[*]",), "read", sub)
            elif isinstance(sub, (ast.For, ast.AsyncFor, ast.comprehension)):
                base = _path(sub.iter, env, self_aliases)
                if base is not None:
                    self._add(base + ("[*]",), "read", sub.iter)
            elif isinstance(sub, ast.Call) and _call_name(sub) in ("getattr", "hasattr") and len(sub.args) >= 2:
                base = _path(sub.args[0], env, self_aliases)
                name = sub.args[1]
                if base is not None and isinstance(name, ast.Constant) and name.value not in MANAGER_NAMES:
                    optional = _call_name(sub) == "hasattr" or len(sub.args) > 2
                    self._add(base + (name.value,), "optional" if optional else "read", sub)

    def _add(self, path: tuple, kind: str, node, call: Optional[ast.Call] = None) -> None:
        item = self.found.setdefault(path, _Found(set(), set(), 0, set(), []))
        item.kinds.add(kind)
        item.contexts.add(self.context)
        site = f"{self.relative}:{node.lineno}"
        if site not in item.sites:
            item.sites.append(site)
            item.sites.sort(key=lambda s: (s.rsplit(":", 1)[0], int(s.rsplit(":", 1)[1])))
        if call is not None:
            item.positional = max(item.positional, sum(not isinstance(a, ast.Starred) for a in call.args))
            item.keywords.update(k.arg for k in call.keywords if k.arg is not None)
        for length in range(1, len(path)):  # reaching a.b.c reads a and a.b
            parent = self.found.setdefault(path[:length], _Found(set(), set(), 0, set(), []))
            parent.kinds.add("read")
            parent.contexts.add(self.context)


def _loop_bindings(target, iterated):
    """``(name, iterated expression)`` for each loop variable: ``for m in x``, ``for i, m in
    enumerate(x)``, ``for a, b in zip(x, y)`` and their nestings."""
    if isinstance(target, ast.Name):
        return [(target.id, iterated)]
    if not isinstance(target, ast.Tuple) or not isinstance(iterated, ast.Call):
        return []
    name = _call_name(iterated)
    if name == "enumerate" and len(target.elts) == 2 and iterated.args:
        return _loop_bindings(target.elts[1], iterated.args[0])
    if name == "zip" and len(target.elts) == len(iterated.args):
        return [binding for t, a in zip(target.elts, iterated.args) for binding in _loop_bindings(t, a)]
    return []


def _constructs_manager(call: ast.Call) -> bool:
    func = call.func
    return (func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None) == "KVCacheManager"


def _is_self_attr(node) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _call_name(call: ast.Call) -> Optional[str]:
    return call.func.id if isinstance(call.func, ast.Name) else None


def _path(node, env, self_aliases) -> Optional[tuple]:
    """The path from the manager to what ``node`` evaluates to, or None if it is not reached
    from the manager."""
    if isinstance(node, ast.Attribute):
        if node.attr in MANAGER_NAMES:
            return ()
        if _is_self_attr(node) and node.attr in self_aliases:
            return self_aliases[node.attr]
        base = _path(node.value, env, self_aliases)
        return None if base is None else base + (node.attr,)
    if isinstance(node, ast.Name):
        return env.get(node.id)
    if isinstance(node, ast.Subscript):
        base = _path(node.value, env, self_aliases)
        return None if base is None else base + ("[*]",)
    if isinstance(node, ast.Call) and _call_name(node) == "getattr" and len(node.args) >= 2:
        name = node.args[1]
        if isinstance(name, ast.Constant) and name.value in MANAGER_NAMES:
            return ()
    return None


def missing_from(candidate, contexts: Iterable[str] = CONTEXTS, surface: Iterable[Use] = None) -> list[str]:
    """What ``candidate`` lacks of ``surface`` (default ``SURFACE``) in ``contexts``: one line per
    missing method, keyword parameter, positional capacity or attribute; empty when it has all.

    ``candidate`` is a class or an instance. A class is checked one level deep (methods and
    their parameters; attributes as class members or as ``self.x = ...`` in its methods); an
    instance is walked along every path (``[*]``: every element)."""
    contexts = set(contexts)
    wanted = [u for u in (SURFACE if surface is None else surface) if set(u.contexts) & contexts and u.kind != "optional"]
    problems = []
    for use in wanted:
        if inspect.isclass(candidate) and len(use.path) > 1:
            continue
        problems.extend(_check(candidate, use))
    return problems


def _check(candidate, use: Use) -> list[str]:
    objects = [candidate]
    for depth, part in enumerate(use.path):
        last = depth == len(use.path) - 1
        nxt = []
        for obj in objects:
            if part == "[*]":
                try:
                    nxt.extend(list(obj.values()) if isinstance(obj, dict) else list(obj))
                except TypeError:
                    return [f"{_prefix(use, depth)} is not a collection (vLLM iterates or indexes it)"]
                continue
            if inspect.isclass(obj):
                if not _class_has(obj, part):
                    return [f"{'method' if last and use.kind == 'call' else 'attribute'} {_prefix(use, depth + 1)}"]
                nxt.append(inspect.getattr_static(obj, part, None))
            else:
                if not hasattr(obj, part):
                    kind = "method" if last and use.kind == "call" else "attribute"
                    return [f"{kind} {_prefix(use, depth + 1)}"]
                nxt.append(getattr(obj, part))
        objects = nxt
    if use.kind == "call":
        return list(dict.fromkeys(p for obj in objects for p in _signature_problems(obj, use)))
    return []


def _prefix(use: Use, depth: int) -> str:
    return ".".join(use.path[:depth]).replace(".[*]", "[*]") or "(the manager)"


def _class_has(cls, name: str) -> bool:
    if any(name in vars(k) or name in getattr(k, "__annotations__", {}) for k in cls.__mro__):
        return True
    return name in _assigned_self_attributes(cls)


def _assigned_self_attributes(cls) -> set[str]:
    names = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            names.update(t.attr for t in targets if _is_self_attr(t))
    return names


def _signature_problems(obj, use: Use) -> list[str]:
    function = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    if not callable(function):
        return [f"{use.name} is not callable (vLLM calls it)"]
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []  # a builtin or C callable: nothing to read
    params = list(signature.parameters.values())
    if inspect.isfunction(function) and not isinstance(obj, staticmethod) and params and params[0].name in ("self", "cls"):
        params = params[1:]  # as the class holds it: vLLM calls it bound
    kinds = {p.kind for p in params}
    problems = []
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        problems += [f"method {use.name}: no keyword parameter {k!r}" for k in use.keywords if k not in names]
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        capacity = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        if capacity < use.positional:
            problems.append(f"method {use.name}: takes {capacity} positional arguments, vLLM passes {use.positional}")
    return problems


def _format(uses: Iterable[Use]) -> str:
    lines = []
    for use in uses:
        extra = f", {use.positional}" if use.positional or use.keywords else ""
        extra += f", {' '.join(use.keywords)!r}" if use.keywords else ""
        lines.append(f"    _use({use.name!r}, {use.kind!r}, {' '.join(use.contexts)!r}{extra}),")
    return "\n".join(lines)


if __name__ == "__main__":
    extracted, call_sites = extract()
    print("SURFACE: tuple[Use, ...] = (\n" + _format(extracted) + "\n)")
    print()
    for name, where in call_sites.items():
        print(f"{name}: {', '.join(where)}")
