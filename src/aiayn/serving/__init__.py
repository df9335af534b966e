"""``aiayn serve``: a translation model behind an HTTP API, with a page to try it.

- :mod:`~aiayn.serving.settings`: the limits and the batching knobs, each with a default;
- :mod:`~aiayn.serving.engine`: the model side (a :class:`~aiayn.inference.translator.Translator`
  and the attention maps), called on one model thread only;
- :mod:`~aiayn.serving.batcher`: dynamic batching: concurrent requests gathered into one
  decoding batch up to a token budget or a short wait, decoded off the event loop, split back;
- :mod:`~aiayn.serving.schemas`: the JSON of requests and answers (pydantic);
- :mod:`~aiayn.serving.validation`: reading a request body within the limits, every refusal a
  4xx JSON error that names the field;
- :mod:`~aiayn.serving.app`: the FastAPI application (``/``, ``/v1/health``, ``/v1/model``,
  ``/v1/translate``, ``/v1/attention``) and ``page.html``, the page at ``/``;
- :mod:`~aiayn.serving.server`: uvicorn on a socket, SIGTERM as a graceful stop.

The load and bad-input test client is a benchmark, not part of the library:
``benchmarks/serving_load.py`` (docs/serving.md, Load test).
"""
