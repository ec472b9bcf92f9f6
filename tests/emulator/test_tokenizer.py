from backends.emulator import tokenizer


def test_same_text_same_ids_and_round_trip() -> None:
    text = "Hello world, this is a test."
    ids = tokenizer.encode(text)
    assert ids == tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert 5 <= len(ids) <= len(text)  # roughly word pieces of up to four characters


def test_about_four_characters_per_token_on_long_text() -> None:
    text = "The quick brown fox jumps over the lazy dog near the riverbank. " * 50
    ratio = len(text) / len(tokenizer.encode(text))
    assert 2.5 <= ratio <= 5.0


def test_shared_system_prompt_is_a_shared_token_prefix() -> None:
    system = {"role": "system", "content": "You are a careful assistant for an online bookshop."}
    a = tokenizer.encode(tokenizer.render_chat([system, {"role": "user", "content": "Recommend a novel."}]))
    b = tokenizer.encode(tokenizer.render_chat([system, {"role": "user", "content": "Where is my order?"}]))
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    sys_only = tokenizer.encode(tokenizer.render_chat([system], add_generation_prompt=False))
    assert common >= len(sys_only)
    assert a[0] == tokenizer.IM_START


def test_content_parts_are_flattened() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert tokenizer.content_text(parts) == "ab"
    assert tokenizer.content_text(None) == ""
