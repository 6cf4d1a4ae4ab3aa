"""The built-in HTTP server: SGLang's native API and the OpenAI ``/v1`` API over one scheduler and engine."""
