"""``tokenmill.lang``: multi-call programs over any OpenAI-compatible server, in the style of
SGLang's frontend language.

    from tokenmill import lang

    @lang.function
    def answer(s, question):
        s += "Q: " + question + "\\nA:"
        s += lang.gen("answer", max_tokens=32, stop="\\n")

    lang.set_default_backend(lang.Endpoint("http://127.0.0.1:8000"))
    print(answer.run(question="What is 2 + 2?")["answer"])

``gen`` (stop, max tokens, regex / JSON schema through structured output), ``select`` (by
prompt logprobs where the server returns them, else by constrained choice), chat roles,
``s.fork(n)`` (branches run concurrently; their shared prefix is sent once first so the server
computes it once), ``Program.run_batch`` and ``run(stream=True)`` + ``text_iter()``. Importing
``tokenmill`` does not import this package; it needs only httpx.
"""

from tokenmill.lang.backend import Endpoint, EndpointError, Scored
from tokenmill.lang.ir import assistant, gen, select, system, user
from tokenmill.lang.program import Program, function, set_default_backend
from tokenmill.lang.state import ForkGroup, ProgramError, ProgramState

__all__ = ["Endpoint", "EndpointError", "ForkGroup", "Program", "ProgramError",
           "ProgramState", "Scored", "assistant", "function", "gen", "select",
           "set_default_backend", "system", "user"]
