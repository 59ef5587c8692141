"""The admin plane: an HTTP+JSON API served inside the engine (``server``) and its client
(``client``, used by the CLI and ``kvtier top``). Neither side imports torch or vLLM."""
