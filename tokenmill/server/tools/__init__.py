"""Tool calling, the server's side of it: the model family's call syntax (``parsers``, the
registry; the shared walk and streamer in ``base``, the syntaxes in ``markers``, ``xml_calls``
and ``leading``), tools and past calls put into a prompt (``prompt``), and ``tool_choice`` as an
output constraint (``choice``) for the grammar engine in ``structured/``. Nothing is imported
here: the CLI reads ``parsers.TOOL_PARSERS`` without loading the grammar library."""
