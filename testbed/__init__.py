"""What the tests and the benchmarks share, so neither imports the other: tiny random models
(``tiny_models``, ``tiny_vlms``), the chat fixtures (``chat``), the coverage matrix's configs and
runner (``coverage/``), the results pages' format (``tables``) and SQuAD's answer scoring
(``squad_score``)."""
