"""The README's example runs and says what it claims."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys):
  text = README.read_text()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  assert len(code.strip().splitlines()) <= 10
  namespace: dict = {}
  exec(compile(code, str(README), "exec"), namespace)
  printed = capsys.readouterr().out
  grads = np.array(re.findall(r"-?\d+\.\d+", printed), float).reshape(4, 3)
  # The gradient is the same for every output unit and differs per input.
  assert np.allclose(grads, grads[:, :1]) and np.ptp(grads[:, 0]) > 0
  assert namespace["x"].capacity.sequences == (8,)
  assert isinstance(namespace["loss"](jnp.ones((4, 3)), namespace["x"]), jnp.ndarray)
