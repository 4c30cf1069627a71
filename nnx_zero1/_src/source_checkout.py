"""``nnx_zero1.adapters`` when ``nnx_zero1`` is imported from a source checkout.

The repository keeps the adapters in ``adapters/`` next to ``nnx_zero1/``;
an installed wheel has them at ``nnx_zero1/adapters/`` (setuptools
``package-dir``). Python run from the repository root imports the source
``nnx_zero1/`` ahead of any installed copy, and that folder has no
``adapters/``; this registers the checkout's ``adapters/`` as the subpackage,
so ``nnx_zero1.adapters.*`` imports the same way in both places.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

__all__ = ["register_source_adapters"]

_NAME = "nnx_zero1.adapters"


def register_source_adapters(package_dir: pathlib.Path) -> bool:
  """Makes ``nnx_zero1.adapters`` the checkout's ``adapters/`` when ``package_dir`` is a source tree.

  Args:
    package_dir: the folder ``nnx_zero1/__init__.py`` was imported from.

  Returns:
    True when it registered the checkout's adapters; False for an installed
    package (which has its own ``adapters/``), a tree with no ``adapters/`` next
    to it, or a subpackage already imported.

  Example::

    >>> import pathlib
    >>> register_source_adapters(pathlib.Path("/nonexistent/nnx_zero1"))
    False
  """
  source = package_dir.parent / "adapters"
  if _NAME in sys.modules or (package_dir / "adapters").is_dir() or not (source / "__init__.py").is_file():
    return False
  spec = importlib.util.spec_from_file_location(
      _NAME, source / "__init__.py", submodule_search_locations=[str(source)]
  )
  assert spec is not None and spec.loader is not None  # a file location always gives both
  module = importlib.util.module_from_spec(spec)
  sys.modules[_NAME] = module
  spec.loader.exec_module(module)
  return True
