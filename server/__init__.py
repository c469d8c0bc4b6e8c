"""specserve front end: command line (and, later, the OpenAI-compatible HTTP server)."""
