"""The code generated for a split reads as the plan: a commented call per stage on its device, and
the model's own argument names."""

from __future__ import annotations

import autosplit
from tests.helpers import small_gpt


def test_generated_source_is_readable():
    model, inputs = small_gpt()
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=inputs, time_limit=2)
    code = split.code
    assert "# stage 0 on cpu" in code and "# stage 1 on cpu" in code
    assert "self.stage0(" in code and "self.stage1(" in code
    assert "def forward(self, idx" in code
