"""The pages speak with one voice: every line that installs the planner is one of the README's install
table's (docs/install.md shows the same table), no page says the planner needs Python >= 3.12 without saying
it is for compile-only targets, the user pages speak a user's words (no word of how the project was built,
no workshop word undefined), the planner's page keeps one path from the VM to a pod, and the planner's
module has one name (``python -m nnx_zero1.plan``)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "planner" / "README.md", *(ROOT / "docs").glob("*.md")])
PLANNER = ROOT / "docs" / "planner.md"
# A command that installs the planner or what it plans with: pip, or the checkout on the path (a TPU VM).
_INSTALL = re.compile(r"^(python3? -m )?pip install |^export PYTHONPATH=")
_FOR_THE_PLANNER = ("planner", "jax-cuda", "maxtext==", "requirements-newest", "flax==")
# Words of the project's own making, or of its internals, that a user planning a run need not know
# (docs/accuracy.md keeps the precise ones and says what each means).
INTERNAL_WORDS = ("the walk", "class clocks", "arms", "the seed", "deferred arms", "lane 2", "way out",
                  "edge", "gallops", "deviceless", "step_jit", "benchmarks.chip_rates", "known_trip_count")


def section(text: str, heading: str) -> str:
  """The text under ``## heading`` up to the next heading of that level."""
  start = text.index(f"\n## {heading}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end if end > 0 else len(text)]


def shell_commands(text: str) -> list[str]:
  """Each shell command a page shows: every line of its bash blocks (``\\`` continuations joined) and every
  inline code span, split at ``&&`` and ``;``, without its comment or surplus spaces."""
  lines = [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
           for line in block.replace("\\\n", " ").splitlines()]
  lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
  parts = (part for line in lines for part in re.split(r"&&|;", line.split(" # ")[0]))
  return [" ".join(part.split()) for part in parts if part.strip()]


def planner_installs(text: str) -> list[str]:
  return [c for c in shell_commands(text) if _INSTALL.match(c) and any(w in c for w in _FOR_THE_PLANNER)]


def sentences(text: str) -> list[str]:
  """A page cut into what is said at once: each line of a code block or a table, each sentence of prose."""
  units = []
  for block in re.split(r"(```.*?```)", text, flags=re.S):
    if block.startswith("```"):
      units += block.splitlines()
      continue
    for paragraph in re.split(r"\n\s*\n", block):
      if paragraph.lstrip().startswith("|"):
        units += paragraph.splitlines()
      else:
        units += re.split(r"(?<=[.!?])\s+(?=[A-Z(`*\[])", " ".join(paragraph.split()))
  return units


README = ROOT / "README.md"
INSTALL_START, INSTALL_END = "<!-- install: start -->", "<!-- install: end -->"


def install_table() -> str:
  """The README's install table, which docs/install.md includes whole."""
  text = README.read_text()
  return text[text.index(INSTALL_START):text.index(INSTALL_END)]


STORY = planner_installs(install_table())


def test_the_install_table_says_what_runs_where_and_why():
  # A TPU VM: --prefix, which keeps the VM's own jax (--target would bring one of its own), and the project
  # from the checkout.
  assert {"python3 -m pip install --prefix /tmp/site flax==0.12.8 optax==0.2.8 tqdm",
          "export PYTHONPATH=$PYTHONPATH:/tmp/site/lib/python3.11/site-packages:$PWD:$PWD/planner",
          'pip install . "./planner[aot]"',  # compile-only targets, Python >= 3.12
          "pip install --no-deps jax-cuda13-plugin==0.12.0.1 jax-cuda13-pjrt==0.12.0.1",
          "pip install --no-deps maxtext==0.2.5"} <= set(STORY), STORY
  rows = [line for line in install_table().splitlines() if line.startswith("| ")][1:]
  assert [r.split("|")[1].strip().split(",")[0] for r in rows][:4] == [
      "where you train (Python >= 3.11", "a TPU VM", "a machine without TPUs",
      "NVIDIA targets: the same machine"]
  assert all(len(r.strip().strip("|").split(" | ")) == 4 and r.split(" | ")[3].strip(" |") for r in rows)
  said = " ".join(install_table().split())
  assert "Python 3.11" in said and "Python >= 3.12" in said and "compile-only" in said
  assert "python3" in said and "not `pip install --target`" in said
  assert "docs/data/device_v5e/run14/install/" in said  # what --target and --prefix put beside the VM's jax
  # The table comes after the README's two set-up commands, and the docs site shows it, not a copy.
  text = README.read_text()
  assert text.index("## Set up") < text.index(INSTALL_START)
  shown = (ROOT / "docs" / "install.md").read_text()
  assert f":start-after: {INSTALL_START}" in shown and f":end-before: {INSTALL_END}" in shown
  assert "pip install" not in shown
  # The lines exactly as they ran on the chip are in the runs' own README, which points at the table.
  kept = (ROOT / "docs/data/device_v5e/README.md").read_text()
  assert "python3 -m pip install" in kept and "README.md#install" in kept


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_line_that_installs_the_planner_is_the_install_tables(page):
  for command in planner_installs(page.read_text()):
    assert command in STORY, f"{page.name}: {command!r} is not a line of the README's install table"


def _about_the_planner(page: Path) -> tuple[str, bool]:
  """The page's text, and whether all of it is about the planner (else only what names it is)."""
  text = page.read_text()
  if page == ROOT / "README.md":
    return section(text, "Will it fit?"), True
  return text, page.parent.name == "planner" or page.stem in ("planner", "accuracy", "pods")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_says_the_planner_needs_python_3_12_but_for_compile_only_targets(page):
  text, whole = _about_the_planner(page)
  for said in sentences(text):
    named = whole or re.search(r"planner|nnx_zero1\.plan|\[aot\]", said)
    if named and re.search(r"Python (>= )?3\.12", said):
      assert "compile-only" in said.lower(), f"{page.name}: {said}"


def test_the_task_pages_speak_the_users_words():
  api = section(PLANNER.read_text(), "Your own loop: the steps the planner compiles, from Python")
  for page, text in (("README.md", (ROOT / "README.md").read_text()),
                     ("docs/planner.md", PLANNER.read_text().replace(api, ""))):
    for word in INTERNAL_WORDS:
      found = re.search(rf"(?<![\w.-]){re.escape(word)}(?![\w-])", text, flags=re.I)
      assert found is None, f"{page}: {text[max(0, found.start() - 80):found.end() + 40]!r}"


def test_the_planners_module_has_one_name():
  for page in PAGES:
    assert "python -m nnx_zero1_plan" not in page.read_text(), page.name


def test_the_readme_opening_holds_for_a_bfloat16_model():
  # Adam's moments take the parameters' dtype (optax): two float32 moments is a float32 model's case only.
  for page in (ROOT / "README.md", ROOT / "docs" / "index.md"):
    opening = " ".join(page.read_text().split("\n\n")[1].split())
    assert "two float32 moments" not in opening
    assert "two moments per parameter, in the parameters' dtype" in opening, page.name


# Pages a user reads: everything but the contributor pages, which may name CI lanes and run folders.
CONTRIBUTOR_PAGES = {"contributing.md", "code_layout.md", "changelog.md"}
USER_PAGES = [p for p in PAGES if p.name not in CONTRIBUTOR_PAGES]
# Words of how the project was built: on no page, the contributor pages, CHANGELOG and runs' READMEs too.
BUILDING_WORDS = (r"\blent\b", r"device tool", r"\bsessions?\b", r"(?-i:\bDESIGN\b)", r"planner's house",
                  r"\b(this|that|last|next|earlier|later|first|second|third|fourth|fifth|sixth|seventh|eighth|"
                  r"ninth|tenth|eleventh|twelfth) rounds?\b", r"\brounds of\b")
# Words of the workshop a user planning a run need not know, on every user page (a page that defines one of
# them where it first uses it may keep it: ALLOWED).
WORKSHOP_WORDS = (r"\bthe walk\b", r"\bwalk(s|ed)?\b", r"class clocks", r"\bthe seed('s)?\b", r"\bseed's\b",
                  r"\barms?\b", r"\bthe edge\b", r"\blane 2\b", r"(?<!_xla_)megascale", r"\bthe book('s)?\b",
                  r"thin pick", r"\bkept (runs?|plans?|cases?)\b", r"\brun ?[1-9]\b(?!/)")
# Words of the project's own bookkeeping, on no user page: its issue numbers, its budgets, CI's lanes, its
# branches and worktrees, its own tests as "ours", and the machines and runs it was recorded on (what a kept
# run needs of them, its README under docs/data/ says). A search's compile budget is the planner's setting.
BOOKKEEPING_WORDS = (r"\bour tests\b", r"(?<!compile )\bbudgets?\b", r"\blanes? [0-9]\b", r"\bCI lanes?\b",
                     r"\b(lowest|newest) lanes?\b", r"\bbranch(es)? `?[a-z]+[0-9]+\b", r"\bworktrees?\b",
                     r"recording machine", r"\bproject's shared\b", r"\bthe machine's time\b",
                     r"\breturned at most\b", r"\bthis release's\b", r"\bthe issue asked\b")
# An issue or pull request by number is the project's own unless a public project's name comes right before it
# (`jax-ml/jax #28376`, `MaxText #5099`, `MaxText issue 5099`): a citation, which a user can follow.
_NUMBERED = re.compile(r"(?<![\w&])#[0-9]+\b|\b(?:issues?|PRs?|pull requests?) #?[0-9]+\b", flags=re.I)
_CITED = re.compile(r"(?:\b[\w.-]+/[\w.-]+|\b[A-Z][\w.-]*) $")


def numbered_references(text: str) -> list[str]:
  """Each issue or pull request the text names by number without the public project it belongs to.

  >>> numbered_references("as MaxText #5099 and jax-ml/jax #28376 found (issue 62; #83)")
  ['issue 62', '#83']
  """
  found = []
  for m in _NUMBERED.finditer(text):
    before = text[max(0, m.start() - 60):m.start()]
    cited = _CITED.search(before)
    if cited is None or cited[0].strip().lower() in ("issue", "issues", "pr", "see", "in", "and"):
      found.append(m[0])
  return found


# Where a page keeps a word, the definition it gives where the word first appears.
ALLOWED = {
    "accuracy.md": {r"\bthe walk\b": "**the walk**", r"\bwalk(s|ed)?\b": "**the walk**",
                    r"\bthe seed('s)?\b": "**the seed**",
                    r"\bseed's\b": "**the seed**", r"\barms?\b": "its **arms**"},
    # The benchmark's own flag is --arms: an arm is one way to train, as its pages define.
    "benchmarks.md": {r"\barms?\b": "**arm**"},
    "benchmarks_aot.md": {r"\barms?\b": "[arm](benchmarks.md"},
    "memory_levers.md": {r"\barms?\b": "[arms](benchmarks.md"},
}


def _prose(text: str) -> str:
  """The page without its fenced code blocks and its inline code spans (commands, paths and names)."""
  return re.sub(r"`[^`\n]+`", "", re.sub(r"```.*?```", "", text, flags=re.S))


def _found(pattern: str, text: str) -> str | None:
  m = re.search(pattern, text, flags=re.I)
  return None if m is None else text[max(0, m.start() - 60):m.end() + 40]


@pytest.mark.parametrize("page", [*PAGES, ROOT / "CHANGELOG.md", ROOT / "ARCHITECTURE.md",
                                  *sorted((ROOT / "docs" / "data").glob("**/README.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_says_how_the_project_was_built(page):
  text = page.read_text()
  for pattern in BUILDING_WORDS:
    assert _found(pattern, text) is None, f"{page.name}: {_found(pattern, text)!r}"


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_user_pages_speak_a_users_words(page):
  text, allowed = _prose(page.read_text()), ALLOWED.get(page.name, {})
  for pattern in WORKSHOP_WORDS:
    if pattern in allowed:
      assert allowed[pattern] in page.read_text(), f"{page.name} keeps {pattern!r} but does not define it"
      continue
    assert _found(pattern, text) is None, f"{page.name}: {_found(pattern, text)!r}"


def test_the_planners_pages_stay_readable():
  assert len(PLANNER.read_text().splitlines()) <= 600
  # accuracy.md also says once how a step is timed and how far a calibration holds, which the others link to,
  # and what a GPU time is, on one GPU too.
  assert len((ROOT / "docs" / "accuracy.md").read_text().splitlines()) <= 475


def test_the_planners_page_has_one_path_from_the_vm_to_a_pod():
  """On the first screen after the one-chip answer: --measure on the VM into a folder, then that folder given
  with --calibration to a larger slice and to two slices, each at the same model and global batch."""
  text = PLANNER.read_text()
  path = section(text, "Quick path").split("### From the VM to a pod: one path\n", 1)[1].split("\n### ", 1)[0]
  assert text.index("### From the VM to a pod") < text.index("### What the one-chip plan says")
  block = re.search(r"```bash\n(.*?)```", path, flags=re.S)[1].replace("\\\n", " ")
  steps = [" ".join(line.split()) for line in block.splitlines()
           if re.match(r"python3? -m nnx_zero1\.plan", line)]
  assert len(steps) == 3, steps
  first, *later = steps
  assert "--topology v5e:1x1" in first and "--measure --out plan_v5e" in first
  assert "--topology v5e:2x4" in later[0] and "--slices 2" in later[1]
  for step in later:
    assert "--calibration plan_v5e" in step
  for flag in ("--model", "--global-batch"):
    assert len({re.search(rf"{flag} (\S+)", s)[1] for s in steps}) == 1, flag
  # The VM's step says python3 (the VM has no python); each printed output is quoted from a kept run.
  assert first.startswith("python3 -m nnx_zero1.plan"), first
  kept = re.findall(r"<!-- output: (\S+) -->", path)
  assert kept and all("step ms (calib.)" in (ROOT / k / "stdout.txt").read_text() for k in kept), kept


# A sample of the planner's output on a page: a text block right under ``<!-- output: FOLDER -->``, FOLDER a
# kept run (its ``command`` and ``stdout.txt``), and right above the marker the bash block of the command that
# printed it.
_SAMPLE = re.compile(r"```bash\n(?P<command>(?:(?!```).)*?)```\s*(?:(?!```).)*?"
                     r"<!-- output: (?P<kept>\S+) -->\n```text\n(?P<sample>.*?)```", flags=re.S)
SAMPLED_PAGES = [ROOT / "README.md", ROOT / "planner" / "README.md", PLANNER, ROOT / "docs" / "pods.md",
                 ROOT / "docs" / "accuracy.md"]


def _flags(command: str) -> dict[str, str]:
  """A planner command's flags and values (a switch's value ""), without the folder it wrote to or the path it
  read a calibration from (the kept run's were its machine's) and whether it said python or python3."""
  words = command.split()
  assert re.fullmatch(r"python3?", words[0]) and words[1:3] == ["-m", "nnx_zero1.plan"], command
  flags: dict[str, str] = {}
  for i, word in enumerate(words[3:], start=3):
    if word.startswith("--"):
      after = words[i + 1] if i + 1 < len(words) else "--"
      flags[word] = "" if after.startswith("--") else after
  flags.pop("--out", None)
  return flags | ({"--calibration": "PATH"} if "--calibration" in flags else {})


def _in_order(wanted: list[str], words: list[str]) -> bool:
  it = iter(words)
  return all(w in it for w in wanted)


def test_every_sample_of_the_planners_output_is_its_commands_as_kept():
  """Each sample is the kept run's output of the command shown above it: every line of it, columns cut
  or not, is a line the run printed (its words in order), and the command is the run's."""
  found = 0
  for page in SAMPLED_PAGES:
    text = page.read_text()
    assert text.count("<!-- output: ") == len(_SAMPLE.findall(text)), page.name  # each marker well placed
    for m in _SAMPLE.finditer(text):
      found += 1
      folder = ROOT / m["kept"]
      lines = m["command"].replace("\\\n", " ").splitlines()  # a block of several commands: one of them
      shown = [_flags(line) for line in lines if line.strip() and not line.startswith("#")]
      assert _flags((folder / "command").read_text()) in shown, (page.name, m["kept"])
      printed = [line.split() for line in (folder / "stdout.txt").read_text().splitlines()]
      for line in m["sample"].splitlines():
        words = line.split()
        assert any(kept[:1] == words[:1] and _in_order(words, kept) for kept in printed), (m["kept"], line)
  assert found >= 3


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_user_page_speaks_of_the_projects_bookkeeping(page):
  text = _prose(page.read_text())
  for pattern in BOOKKEEPING_WORDS:
    assert _found(pattern, text) is None, f"{page.name}: {_found(pattern, text)!r}"
  assert numbered_references(text) == [], page.name


def test_a_bookkeeping_word_is_found_and_a_citation_is_not():
  assert numbered_references("the lever (issue 62) and (#83), PR 7") == ["issue 62", "#83", "PR 7"]
  assert numbered_references("measured by MaxText #5099; jax-ml/jax #28376; MaxText issue 12") == []
  said = "CPU runs (our tests) in lane 1, as the CPU budget held it, within the compile budget"
  assert [p for p in BOOKKEEPING_WORDS if _found(p, said)] == [r"\bour tests\b", r"(?<!compile )\bbudgets?\b",
                                                              r"\blanes? [0-9]\b"]
