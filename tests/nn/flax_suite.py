"""A pytest plugin: Flax's own recurrent tests, run against jaxlod's drop-ins.

tests/nn/test_flax_suite.py extracts ``tests/linen/linen_recurrent_test.py``
and ``tests/nnx/nn/recurrent_test.py`` from the sdist of the installed Flax
and runs them in a child pytest with ``-p tests.nn.flax_suite``. This module
then puts `jaxlod.nn.RNN`, `jaxlod.nn.Bidirectional`, `jaxlod.nn.nnx.RNN`
and `jaxlod.nn.nnx.Bidirectional` in the places of ``flax.linen.RNN``,
``flax.linen.Bidirectional``, ``flax.nnx.RNN`` and ``flax.nnx.Bidirectional``,
and expects exactly the tests of `EXPECTED_FAILURES` to fail. No Flax code is
copied here.

Flax's tests reach the layers as ``nn.RNN`` (``from flax import linen as
nn``), ``linen.RNN`` and ``nnx.RNN``, attributes of the packages looked up
when a test runs, so replacing the package attributes is enough. The modules
``flax.linen.recurrent`` and ``flax.nnx.nn.recurrent`` keep Flax's own
classes: the tests import only ``flip_sequences`` from there, and Flax's
other layers keep working as Flax wrote them.
"""

import flax.linen
import flax.nnx
import pytest

import jaxlod.nn
import jaxlod.nn.nnx

# (package, name, drop-in): what the plugin replaces.
REPLACEMENTS = (
  (flax.linen, "RNN", jaxlod.nn.RNN),
  (flax.linen, "Bidirectional", jaxlod.nn.Bidirectional),
  (flax.nnx, "RNN", jaxlod.nn.nnx.RNN),
  (flax.nnx, "Bidirectional", jaxlod.nn.nnx.Bidirectional),
)

# Flax's tests that build an RNN or a Bidirectional (flax 0.12.8), found by
# reading the two files: a test counts when its body constructs ``nn.RNN``,
# ``nn.Bidirectional``, ``linen.RNN`` or ``nnx.RNN`` (``nnx.Bidirectional``
# has no test of its own). 15 in linen_recurrent_test.py (11 of RNNTest's 17,
# all 4 of BidirectionalTest's) and 12 in recurrent_test.py (all of TestRNN's;
# none of TestLSTMCell's 8): 27. Issue 53 counted 29, which is the count when
# RNNTest's test_numerical_equivalence_single_batch_nn_scan and
# test_numerical_equivalence_single_batch_jax_scan are included; they build
# ``nn.scan(nn.LSTMCell)`` and ``jax.lax.scan`` over a cell, never an RNN, so
# they run Flax's code only and are not counted here. The other tests (cells,
# ``flip_sequences``, scans) also run, and must pass.
BUILDS_RNN = (
  "linen_recurrent_test.py::RNNTest::test_rnn_basic_forward",
  "linen_recurrent_test.py::RNNTest::test_rnn_multiple_batch_dims",
  "linen_recurrent_test.py::RNNTest::test_rnn_unroll",
  "linen_recurrent_test.py::RNNTest::test_rnn_time_major",
  "linen_recurrent_test.py::RNNTest::test_rnn_with_spatial_dimensions",
  "linen_recurrent_test.py::RNNTest::test_numerical_equivalence",
  "linen_recurrent_test.py::RNNTest::test_numerical_equivalence_with_mask",
  "linen_recurrent_test.py::RNNTest::test_numerical_equivalence_single_batch",
  "linen_recurrent_test.py::RNNTest::test_reverse",
  "linen_recurrent_test.py::RNNTest::test_reverse_but_keep_order",
  "linen_recurrent_test.py::RNNTest::test_basic_seq_lengths",
  "linen_recurrent_test.py::BidirectionalTest::test_bidirectional",
  "linen_recurrent_test.py::BidirectionalTest::test_shared_cell",
  "linen_recurrent_test.py::BidirectionalTest::test_custom_merge_fn",
  "linen_recurrent_test.py::BidirectionalTest::test_return_carry",
  "recurrent_test.py::TestRNN::test_rnn_with_lstm_cell",
  "recurrent_test.py::TestRNN::test_rnn_with_gru_cell",
  "recurrent_test.py::TestRNN::test_rnn_time_major",
  "recurrent_test.py::TestRNN::test_rnn_reverse",
  "recurrent_test.py::TestRNN::test_rnn_with_seq_lengths",
  "recurrent_test.py::TestRNN::test_rnn_with_keep_order",
  "recurrent_test.py::TestRNN::test_rnn_equivalence_with_flax_linen",
  "recurrent_test.py::TestRNN::test_rnn_with_unroll",
  "recurrent_test.py::TestRNN::test_rnn_with_custom_cell",
  "recurrent_test.py::TestRNN::test_rnn_with_different_dtypes",
  "recurrent_test.py::TestRNN::test_rnn_with_variable_batch_size",
  "recurrent_test.py::TestRNN::test_recurrent_dropout",
)

# The two tests issue 53 counts beside BUILDS_RNN (29 in all): scans of a
# Flax cell, beside the RNN tests, that must pass with the drop-ins installed.
SCANS = (
  "linen_recurrent_test.py::RNNTest::test_numerical_equivalence_single_batch_nn_scan",
  "linen_recurrent_test.py::RNNTest::test_numerical_equivalence_single_batch_jax_scan",
)

# Flax's tests that fail against the drop-ins by design, with the reason
# (quoted in the documentation): each is marked xfail(strict=True), so it
# must fail, and every other test must pass.
EXPECTED_FAILURES = {
  "linen_recurrent_test.py::RNNTest::test_numerical_equivalence_with_mask": (
    "The drop-in returns zeros at the steps past each sequence's length, "
    "where flax.linen.RNN runs the cell over the padding, and this test "
    "compares the outputs at every step, padding included."
  ),
}


def install():
  """Puts the drop-ins in the places of Flax's layers."""
  for package, name, dropin in REPLACEMENTS:
    setattr(package, name, dropin)


def pytest_configure(config):
  del config
  install()


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    reason = EXPECTED_FAILURES.get(item.nodeid)
    if reason is not None:
      item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
