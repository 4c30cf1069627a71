"""The pages speak with one voice: every line that installs the planner is one of docs/planner.md's "Install"
section's, no page says the planner needs Python >= 3.12 without saying it is for compile-only targets, the
task pages (the README and docs/planner.md but its API table) speak the user's words, and the planner's
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


STORY = planner_installs(section(PLANNER.read_text(), "Install"))


def test_the_install_section_says_what_runs_where():
  assert {"python3 -m pip install flax==0.12.8 optax==0.2.8 tqdm",  # a TPU VM: beside its own jax
          "export PYTHONPATH=$PYTHONPATH:$PWD:$PWD/planner",  # ... the project from the checkout
          'pip install . "./planner[aot]"',  # compile-only targets, Python >= 3.12
          "pip install --no-deps jax-cuda13-plugin==0.12.0.1 jax-cuda13-pjrt==0.12.0.1"} <= set(STORY), STORY
  said = " ".join(section(PLANNER.read_text(), "Install").split())
  assert "Python 3.11" in said and "Python >= 3.12" in said and "compile-only" in said
  # The lines that ran on the chip are where the section says they are.
  assert "python3 -m pip install" in (ROOT / "docs/data/device_v5e/README.md").read_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_line_that_installs_the_planner_is_the_install_sections(page):
  for command in planner_installs(page.read_text()):
    assert command in STORY, f"{page.name}: {command!r} is not a line of docs/planner.md's Install"


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
