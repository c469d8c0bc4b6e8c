"""specserve front end: the OpenAI-compatible HTTP server and the `specserve` command line."""
