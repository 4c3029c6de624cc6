"""Structural checks against a typing.Protocol, without mypy: every member of the Protocol
present, async exactly when the Protocol's is, and callable the same way (each Protocol parameter
accepted with the same kind; any extra parameter has a default). ``obj`` is a class, or an
instance (then its attributes count too, e.g. those a wrapper's ``__getattr__`` forwards)."""
import inspect


def _methods(proto: type) -> list[str]:
    return sorted(n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_"))


def mismatches(obj: object, proto: type) -> list[str]:
    """Why ``obj`` does not satisfy ``proto`` (empty when it does)."""
    bad = [f"{name}: missing" for name in getattr(proto, "__annotations__", {})
           if not isinstance(obj, type) and not hasattr(obj, name)]
    for name in _methods(proto):
        impl = getattr(obj, name, None)
        if impl is None:
            bad.append(f"{name}: missing")
            continue
        want = getattr(proto, name)
        if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(impl):
            bad.append(f"{name}: async in one, not the other")
        have = inspect.signature(impl).parameters
        wanted = dict(inspect.signature(want).parameters)
        if not isinstance(obj, type):              # a bound method: no self
            wanted.pop(next(iter(wanted)))
        for p in wanted.values():
            q = have.get(p.name)
            if q is None:
                # a keyword (or **kw) the implementation takes through its own **kw
                if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) and any(x.kind is x.VAR_KEYWORD for x in have.values()):
                    continue
                bad.append(f"{name}: no parameter {p.name!r}")
            elif q.kind != p.kind and not (p.kind is p.KEYWORD_ONLY and q.kind is q.POSITIONAL_OR_KEYWORD):
                bad.append(f"{name}: {p.name!r} is {q.kind.description}, wanted {p.kind.description}")
            elif p.default is not p.empty and q.default is q.empty:
                bad.append(f"{name}: {p.name!r} needs a default")
        for q in have.values():
            if q.name not in wanted and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD) and q.default is q.empty:
                bad.append(f"{name}: extra parameter {q.name!r} without a default")
    return bad
