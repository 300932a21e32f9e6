"""benchmark.py's and compare.py's own tools: measuring, reporting, compare's runner, the
variants by name. They import the training core (ampkit); no train script imports them."""
