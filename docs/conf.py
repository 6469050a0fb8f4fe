"""Sphinx configuration of jaxlod's documentation site.

Build it from the repository root, warnings as errors::

  python -m pip install -e '.[docs]'
  python -m sphinx -W -b html docs docs/_build/html

The site is MyST Markdown (the pages of docs/, docs/guide/ and docs/api/),
the notebooks of notebooks/ rendered with their outputs (MyST-NB), and an
API reference generated from the docstrings (autodoc, autosummary,
napoleon). ``-D nb_execution_mode=off`` builds it without running any
notebook (those not executed yet then show no outputs).

Notebooks run once per CI run: tests/test_notebooks.py executes each one
and saves the executed copy as ``EXECUTED_NOTEBOOKS/<name>.ipynb``. At build
time each notebook is copied into docs/notebooks/ (generated, ignored by
git): the executed copy when it exists and is newer than the notebook, else
the notebook itself, stored without outputs, which MyST-NB then executes.
So a build after the tests executes none, and a fresh clone executes them
all.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from pathlib import Path

from flax import linen, nnx

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent

# Where tests/test_notebooks.py saves the notebooks it executed, one
# ``<name>.ipynb`` each: the one place the site names this folder.
EXECUTED_NOTEBOOKS = ROOT / "build" / "executed_notebooks"
# The notebooks, and where the build stages them (generated).
NOTEBOOKS = ROOT / "notebooks"
STAGED_NOTEBOOKS = DOCS / "notebooks"
# The figure of the landing page, drawn at build time (generated).
SCHEDULE_FIGURE = DOCS / "_generated" / "schedule.png"

# The modules whose `__all__` is jaxlod's public API, which the API reference
# documents (tests/helpers.py reads this list; tests/test_docs_site.py
# compares it with the names of docs/api/).
PUBLIC_MODULES = [
  "jaxlod",
  "jaxlod.ops",
  "jaxlod.nn",
  "jaxlod.nn.nnx",
  "jaxlod.data",
  "jaxlod.parallel",
  "jaxlod.interop",
  "jaxlod.testing",
]

# This tree's jaxlod, for autodoc and for the kernels that run notebooks
# (which import the repository's `examples` and `benchmarks` from its root too).
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
  p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
)
sys.path.insert(0, str(DOCS / "_scripts"))
schedule_figure = importlib.import_module("schedule_figure")
stage_notebooks = importlib.import_module("stage_notebooks")

EXECUTED = stage_notebooks.stage(NOTEBOOKS, EXECUTED_NOTEBOOKS, STAGED_NOTEBOOKS)
schedule_figure.write(SCHEDULE_FIGURE)


# -- Project -------------------------------------------------------------------

project = "jaxlod"
author = "the jaxlod authors"
copyright = "the jaxlod authors"
release = version = importlib.import_module("jaxlod").__version__

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]
templates_path = ["_templates"]
# changes.md appears in the site inside api_changes.md, one heading level
# down, under one title.
exclude_patterns = [
  "_build",
  "_scripts",
  "_generated",
  "**.ipynb_checkpoints",
  "changes.md",
]

# -- HTML ----------------------------------------------------------------------

html_theme = "sphinx_book_theme"
html_title = "jaxlod"
html_theme_options = {
  "show_toc_level": 2,
  "home_page_in_toc": True,
  # The book theme has no top bar; unset, its base theme adds one holding a
  # second search field.
  "navbar_persistent": [],
}

# -- MyST and MyST-NB ----------------------------------------------------------

myst_enable_extensions = ["colon_fence", "dollarmath"]
# Anchors for headings down to ###, so that `page.md#a-heading` resolves.
myst_heading_anchors = 3
# Local links are checked: a link to a missing page, file or heading is a
# warning, which `-W` makes an error.
myst_all_links_external = False

nb_execution_mode = "auto"
# "auto" runs every notebook that has a code cell without outputs, as an
# executed copy may have (a cell of definitions): the staged executed copies
# are excluded by name.
nb_execution_excludepatterns = [f"notebooks/{name}" for name in EXECUTED]
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
# Markdown that a cell displays is MyST, which has tables (CommonMark has none).
nb_render_markdown_format = "myst"

# -- API reference -------------------------------------------------------------

autosummary_generate = True
autodoc_member_order = "bysource"
# Signatures show names and defaults; each docstring states its arguments'
# types and shapes (Flax's documentation does the same).
autodoc_typehints = "none"
# `setup` of a Flax module is Flax's hook, with Flax's docstring.
autodoc_default_options = {"exclude-members": "__init__, __new__, setup"}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Returns: ``(a, b)``: text" keeps its type beside its text.
napoleon_use_rtype = False
# An attribute's docstring entry states its shape; its annotation would add
# JAX's internal class path.
napoleon_attr_annotations = False
# A name in single backticks in a docstring (`x`, `config.steps`) reads as
# code, as in the Markdown pages, not as reST's default italic title.
default_role = "literal"
# The page's contents name a method `to_list()`, not `LoDTensor.to_list()`.
toc_object_entries_show_parents = "hide"

# Every reference to a jaxlod name must resolve. This build reaches no
# documentation server, so there is no intersphinx inventory for Python,
# NumPy, JAX, Flax, optax or PyTorch: a reference to one of their names stays
# plain text, and is not checked.
nitpicky = True
nitpick_ignore_regex = [
  (r"py:.*", r"(jax|jaxlib|flax|optax|numpy|np|jnp|torch|grain|orbax)(\..*)?"),
  (r"py:.*", r"(typing|collections|collections\.abc|enum|dataclasses|os)\..*"),
  (r"py:.*", r"(int|float|bool|str|bytes|object|tuple|list|dict|set|None|Any)"),
]


def field_names() -> frozenset[str]:
  """The fields of the public dataclasses, NamedTuples and Flax modules."""
  names = set()
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    for obj in (getattr(module, attr) for attr in module.__all__):
      if not isinstance(obj, type):
        continue
      if dataclasses.is_dataclass(obj):
        names.update(field.name for field in dataclasses.fields(obj))
      names.update(getattr(obj, "_fields", ()))
  return frozenset(names)


FIELDS = field_names()


def skip_fields(app, what, name, obj, skip, options):
  """Leaves fields out of a class's members: its ``Attributes:`` lists them."""
  routine = inspect.isroutine(obj) or isinstance(obj, property)
  return True if what == "class" and name in FIELDS and not routine else None


def module_signature(app, what, name, obj, options, signature, return_annotation):
  """A Flax module's constructor arguments.

  Flax adds ``parent`` and ``name`` to a Linen module's fields, and an NNX
  module's metaclass hides its ``__init__`` behind ``(*args, **kwargs)``.
  """
  if not inspect.isclass(obj):
    return None
  if issubclass(obj, linen.Module):
    params = list(inspect.signature(obj).parameters.values())
    params = [p for p in params if p.name not in ("parent", "name")]
  elif issubclass(obj, nnx.Module):
    params = list(inspect.signature(obj.__init__).parameters.values())[1:]
  else:
    return None
  params = [p.replace(annotation=inspect.Parameter.empty) for p in params]
  # On one line: a default whose repr spans several (a FrozenDict, as the
  # drop-in RNN's `split_rngs`) would break the signature.
  return " ".join(str(inspect.Signature(params)).split()), return_annotation


def setup(app):
  app.connect("autodoc-skip-member", skip_fields)
  app.connect("autodoc-process-signature", module_signature)
