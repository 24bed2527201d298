"""OpenAI-compatible HTTP server. Reading order: errors -> protocol -> engine_loop -> detok/sse/responses ->
generate -> metrics -> app -> cli."""
