"""Documents made from a sweep's rows for people to read, keep and share: an HTML page with plots,
an Excel workbook, a comparison of two sweeps with its regression gate, and a written analysis by a
language model served through Ollama. Each module has one entry function of plain arguments."""
