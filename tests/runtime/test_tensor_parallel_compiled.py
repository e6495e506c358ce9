"""Tensor-parallel stages compiled (``compile=True``, inductor) train like the unsplit model, in float64 on
two gloo processes, as :mod:`tests.runtime.test_tensor_parallel` checks them eager (a file of its own: the
compiles take the longest of any test, and alone here they run beside the suite's other files)."""

from __future__ import annotations

import pytest

from tests.tp_cases import sequence_parallel, train_case


def test_compiled_tp_stages_train_like_the_unsplit_model(gloo, tmp_path):
    """``compile=True`` (inductor) after tp, as torchtitan orders them: the Llama (in one decoder layer: inductor's
    time grows with the graph) with sequence parallelism and its vocabulary-parallel embedding and head, twice (the
    first time without the evaluation, whose graphs compile apart), so that the second compile finds the first's
    training graphs in inductor's on-disk cache, which the ranks share and whose key does not hold the rank (a rank
    then ran the other's slice of the tokens: a loss 0.4% off, silently, until
    :func:`autosplit.compat.rank_local_compile`)."""
    pytest.importorskip("transformers")
    sequence = sequence_parallel(str(tmp_path), 1, "llama-1")
    gloo(2).run(train_case, [("llama-1", sequence, True, False), ("llama-1", sequence, True)])
