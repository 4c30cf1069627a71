"""Eight virtual CPU devices for every test and doctest, and one compilation cache for the run; XLA_FLAGS must
be set before jax is imported."""

import os

# AVX2 is the widest vector ISA the bit-identity tests are sized for: on AVX-512 hosts XLA's CPU
# backend rounds some shards of the test MLP (16-element remainders) differently from the whole
# leaf, a codegen artifact that has nothing to do with Zero-1 (docs/limitations.md).
_FLAGS = os.environ.get("XLA_FLAGS", "")
if "--xla_cpu_max_isa" not in _FLAGS:
  _FLAGS += " --xla_cpu_max_isa=AVX2"
# Eight virtual devices share one thread pool of the host's size. With asynchronous dispatch
# the next program's launches can take the pool threads that the current program's collective
# is waiting for: a deadlock that XLA ends by aborting the process ("Fatal Python error:
# Aborted"), seen at random tests on a 2-core host. Synchronous dispatch (set below, before the
# backend starts) launches one program at a time.
# The virtual devices' collectives wait for each other on that pool; on a loaded host (two test
# workers on two cores) a wait can outlast XLA's default rendezvous timeout, which aborts the
# process ("Fatal Python error: Aborted"). Waiting longer costs nothing when nothing is stuck.
for _flag in ("--xla_cpu_collective_timeout_seconds", "--xla_cpu_collective_call_terminate_timeout_seconds"):
  if _flag not in _FLAGS:
    _FLAGS += f" {_flag}=1200"
# Single-threaded Eigen: the intra-op pool every virtual device's ops share is one contender less for
# the host's two cores (it made the suite's rare hang rarer, not gone; the hang's cause is the client's
# pool, PJRT_NPROC below) and costs these small programs nothing on two cores.
if "--xla_cpu_multi_thread_eigen" not in _FLAGS:
  _FLAGS += " --xla_cpu_multi_thread_eigen=false"
# LLVM's optimisation of each compiled program is most of the suite's time, and the suite
# compiles thousands of small programs that run once, so the tests skip it (a quarter less time).
# A bit-identity test compiles Zero-1 and nnx.Optimizer at the same level; every one passes at
# both levels. The examples the tests run in child processes (the quickstart, the engine and
# Tunix examples, the README's benchmark) drop these flags, so Zero-1 is still compared with
# nnx.Optimizer bit for bit at XLA's default level.
if "--xla_backend_optimization_level" not in _FLAGS:
  _FLAGS += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_force_host_platform_device_count=8").strip()
# XLA's CPU client runs each device's part of a program on its own pool thread, and sizes that pool by the
# host's cores, at least the device count: 8 threads on a 2-core host. Eager ops on arrays sharded over the
# devices queue up to 32 programs per device; each queued part holds a pool thread while it waits for the
# programs before it, so a program with a collective can wait for threads that wait for it: the suite's rare
# hang (tests/core/test_virtual_devices.py queues such ops and hangs without this). A larger pool
# (PJRT_NPROC, read when the backend starts; the test workers' children inherit it) leaves threads to spare.
os.environ.setdefault("PJRT_NPROC", "32")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)
assert jax.device_count() == 8, "tests need 8 virtual CPU devices; import jax after conftest"

# The suite compiles many programs more than once (the nnx.Optimizer step each comparison trains, a
# parametrisation's twin, the same eager op in every test): jax's persistent compilation cache, in a folder
# the run's test workers share and the run removes, compiles each once. Its key is the program, its devices,
# jax's and XLA's versions and flags, so a hit is the executable the compile would have made; an entry a
# worker reads while the other still writes it fails to load, and jax compiles it again.
_COMPILES = os.environ.get("NNX_ZERO1_TEST_COMPILES")
if _COMPILES is None:  # pytest's first process, before its workers start (they inherit the variable)
  _COMPILES = os.environ["NNX_ZERO1_TEST_COMPILES"] = tempfile.mkdtemp(prefix="nnx-zero1-compiles-")
  atexit.register(shutil.rmtree, _COMPILES, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILES)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

import importlib  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402
from _pytest.doctest import DoctestModule  # noqa: E402

ROOT = pathlib.Path(__file__).parent
# Folders whose doctests run on the module under its one importable name.
_PACKAGE_OF = {
    ROOT / "adapters": "nnx_zero1.adapters",
    ROOT / "tests" / "support" / "reference_engine": "tests.support.reference_engine",
}


class _PackageDoctests(DoctestModule):
  """Doctests of ``adapters/X.py`` run on ``nnx_zero1.adapters.X`` (the one name the package has),
  those of ``tests/support/reference_engine/X.py`` on ``tests.support.reference_engine.X``.

  Imported by path, pytest would load each file a second time under another top-level name
  (``adapters.X``, a name that belongs to an unrelated PyPI project; ``reference_engine.X``), with
  its own copies of every class and module-level cache.
  """

  def _getobj(self):
    package = _PACKAGE_OF[self.path.parent]
    return importlib.import_module(package + ("" if self.path.stem == "__init__" else f".{self.path.stem}"))


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
  collectors = yield
  if file_path.parent not in _PACKAGE_OF:
    return collectors
  return [
      _PackageDoctests.from_parent(parent, path=file_path) if type(c) is DoctestModule else c
      for c in collectors
  ]

# Never collected for doctests: importing it imports maxtext (Python >= 3.12), which changes
# process-wide settings (flax_always_shard_variable=False, wrapped jax.lax functions) for every test
# collected after it. tests/adapters/test_maxtext_engine.py imports it itself and puts those settings back.
collect_ignore = ["adapters/_maxtext_engine.py"]


# The slowest test files first. Two workers each take whole files in collection order, so a heavy
# file collected last runs alone at the end (the Tunix trainers were the last minutes of CI).
# Within a file the order is unchanged.
_SLOWEST_FIRST = (
    "test_tunix_trainers.py", "test_tunix.py", "test_bench.py", "test_optimizer_coverage.py",
    "test_random_chains.py", "test_maxtext.py", "test_zero2.py", "test_offload.py",
    "test_mixed_precision.py", "test_multiprocess.py", "test_readme_commands.py",
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_runtest_teardown(item, nextitem):
  # XLA's CPU client paces each device to a fixed number of programs in flight and, in this suite,
  # some launches never give their slot back while jax's caches hold their programs: after a few
  # thousand tests in one worker a device had none left, its part of the next multi-device program
  # never started, and the other seven waited at the all-reduce until the rendezvous timeout
  # aborted the worker. Dropping jax's caches when a worker moves to another file gives the slots
  # back. Within a file the caches stay: its tests check that a trainer compiles once against
  # module-scoped fixtures, and clearing after every test would double the suite's time.
  if nextitem is None or nextitem.path != item.path:
    jax.clear_caches()


# A test that hangs is ended by pytest-timeout, whose stack dump an xdist worker's end may not show. Each
# worker also keeps, in .test-hangs/ at the root, the test it is running and, where that test outlives its
# limit less a margin, every Python thread's stack (faulthandler writes it from its own thread, whatever the
# main one is stuck in); .ci/run prints the stacks when the suite fails.
_HANGS = ROOT / ".test-hangs"
_BEFORE_THE_LIMIT_S = 20


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  import faulthandler

  limit = float(item.config.getini("timeout") or 0)
  if limit <= _BEFORE_THE_LIMIT_S:
    return (yield)
  _HANGS.mkdir(exist_ok=True)
  with open(_HANGS / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.txt", "w") as record:
    record.write(f"{item.nodeid}\n")
    record.flush()
    faulthandler.dump_traceback_later(limit - _BEFORE_THE_LIMIT_S, file=record)
    try:
      return (yield)
    finally:
      faulthandler.cancel_dump_traceback_later()
      record.seek(0)  # it ended: a dump of its stack, written late in a long run, names no hang
      record.truncate()
