"""Streamed tool-call parsing reuses its earlier steps (server.tool_parsers: ToolParser.streamer): at every prefix
of a growing output the stream's parse equals the parser's stateless parse, and the pythonic parser's character
scan looks at each character once over a whole stream (it rescanned the whole output at every step: a 20 KB
argument streamed 4 characters a step took ~17 ms a step at the end on the dev VM, 3.9 s in all)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from server.tool_calls import ToolChoice, ToolStream
from server.tool_parsers import TOOL_PARSERS, _PythonicStream

# Characters that move the pythonic scan (brackets, quotes, escapes, separators) and some that do not.
_ALPHABET = "[](){},'\"\\= \nabxy_1"
_CALL = st.builds(
    lambda name, key, value: f"{name}({key}={value!r})",
    st.sampled_from(["get_weather", "f", "write_file"]),
    st.sampled_from(["city", "path", "x"]),
    st.one_of(st.text(alphabet=_ALPHABET, max_size=12), st.integers(), st.lists(st.integers(), max_size=3)),
)
_PYTHONIC = st.one_of(
    st.builds(
        lambda lead, calls, tail: lead + "[" + ", ".join(calls) + tail,
        st.sampled_from(["", "  ", "\n"]),
        st.lists(_CALL, max_size=3),
        st.sampled_from(["]", "", "] and more", ", ]", "]\n"]),
    ),
    st.text(alphabet=_ALPHABET, max_size=40).map(lambda t: "[" + t),
    st.text(alphabet=_ALPHABET, max_size=40),
)


@settings(max_examples=300, deadline=None)
@given(text=_PYTHONIC, cuts=st.lists(st.integers(min_value=1, max_value=80), max_size=12))
def test_pythonic_stream_equals_the_stateless_parse_at_every_prefix(text, cuts):
    parser = TOOL_PARSERS["pythonic"]
    stream = parser.streamer()
    points = sorted({c for c in cuts if c < len(text)}) + [len(text)]
    for k, cut in enumerate(points):
        final = k == len(points) - 1
        assert stream(text[:cut], final) == parser.parse(text[:cut], final), (text, cut)


@settings(max_examples=100, deadline=None)
@given(text=_PYTHONIC, step=st.integers(min_value=1, max_value=9))
def test_tool_streams_send_what_the_stateless_parse_sends(text, step):
    """For every parser, a ToolStream (which parses with its choice's streamer) sends the same content and call
    deltas as one parsing each prefix whole."""

    def sent(stream):
        content, calls = "", []
        cuts = list(range(step, len(text), step)) + [len(text)]
        for k, cut in enumerate(cuts):
            delta, deltas = stream.step(text[:cut], final=k == len(cuts) - 1)
            content += delta
            calls += [(d["function"]["name"], d["function"]["arguments"]) for d in deltas]
        return content, calls

    for name, parser in TOOL_PARSERS.items():
        choice = ToolChoice("auto", parser=parser)
        stateless = ToolStream(choice)
        stateless.parse = choice.parse
        assert sent(ToolStream(choice)) == sent(stateless), name


def test_pythonic_stream_scans_each_character_once():
    arg = "x, [y] (z) \\' " * 1500  # 21 KB of argument that moves the scan
    text = f'[write_file(path="a.txt", content={arg!r}), get_time(zone="cet")]'
    stream = _PythonicStream()
    for cut in range(4, len(text), 4):
        stream.parse(text[:cut], False)
    parsed = stream.parse(text, True)
    assert [c.name for c in parsed.calls] == ["write_file", "get_time"]
    assert stream.scan.scanned <= len(text), stream.scan.scanned  # the stateless parse: ~len(text)^2 / 8 here
