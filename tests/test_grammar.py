"""The generated Spanish→English corpus: determinism, the required phenomena, alignments, files."""

import pytest

from atencion.demo.grammar import Pair, generate, split, translate_known, write_corpus


@pytest.fixture(scope="module")
def draw() -> list[Pair]:
    return generate(20000, seed=0)


def english(src: str) -> str | None:
    pair = translate_known(src)
    return None if pair is None else pair.tgt


def test_generate_is_deterministic_for_a_seed_and_differs_across_seeds():
    assert generate(300, seed=3) == generate(300, seed=3)
    assert generate(300, seed=3) != generate(300, seed=4)


def test_the_grammar_translates_el_gato_negro_come_el_raton_as_the_black_cat_eats_the_mouse():
    pair = translate_known("el gato negro come el ratón")
    assert pair is not None and pair.tgt == "the black cat eats the mouse"
    assert pair.alignment == ((0, 0), (1, 2), (2, 1), (3, 3), (4, 4), (5, 5))


def test_translate_known_gives_back_every_drawn_pair(draw):
    """translate_known is the grammar's own translation: it recognises what generate draws."""
    for pair in draw[:3000]:
        assert translate_known(pair.src) == pair


@pytest.mark.parametrize("src", [
    "el gato negro come",                        # comer needs an object
    "gato el negro come el ratón",               # article after the noun
    "el gato negro come el ratón ratón",         # trailing word
    "el gato lee el libro",                      # leer takes a person as subject
    "el banco es viejo",                         # a bare banco with no context: bank or bench?
    "el hombre ve el banco",                     # the same
    "el gato come el ratón que el hombre ve que el perro come",   # two relative clauses
])
def test_translate_known_rejects_sentences_the_grammar_cannot_produce(src):
    assert translate_known(src) is None


@pytest.mark.parametrize("src, tgt", [
    ("la casa blanca es vieja", "the white house is old"),
    ("los gatos negros duermen", "the black cats sleep"),
    ("las casas blancas eran grandes", "the white houses were big"),
    ("un gato viejo come una manzana", "an old cat eats an apple"),
    ("unas niñas felices verán los perros", "some happy girls will see the dogs"),
])
def test_adjectives_follow_the_noun_in_spanish_and_precede_it_in_english(src, tgt):
    assert english(src) == tgt


@pytest.mark.parametrize("src", [
    "la casa blanco es vieja", "los gatos negro duermen", "el casa blanca es vieja",
    "los gato negros duermen", "la casa blanca es viejo",
])
def test_articles_and_adjectives_must_agree_with_the_noun(src):
    assert translate_known(src) is None


@pytest.mark.parametrize("src, tgt", [
    ("el gato come el ratón", "the cat eats the mouse"),
    ("los gatos comen el ratón", "the cats eat the mouse"),
    ("el gato comió los ratones", "the cat ate the mice"),
    ("el gato comía el ratón", "the cat was eating the mouse"),
    ("los gatos comían el ratón", "the cats were eating the mouse"),
    ("los gatos comerán el ratón", "the cats will eat the mouse"),
    ("la mujer será feliz", "the woman will be happy"),
    ("el gato comen el ratón", None),
    ("los gatos come el ratón", None),
])
def test_the_verb_agrees_with_its_subject_and_carries_the_tense(src, tgt):
    assert english(src) == tgt


def test_a_relative_clause_puts_distance_between_the_subject_and_its_verb():
    pair = translate_known("el libro que los estudiantes leían era difícil")
    assert pair is not None and pair.tgt == "the book that the students were reading was difficult"
    assert {(5, 5), (5, 6), (6, 7)} <= set(pair.alignment)   # leían → were reading; era → was
    assert english("los libros que el estudiante leía eran difíciles") == \
        "the books that the student was reading were difficult"
    assert translate_known("los libros que el estudiante leía era difíciles") is None   # era must agree with libros
    assert english("el gato que come el ratón duerme") == "the cat that eats the mouse sleeps"
    assert english("el hombre ve el libro que la mujer escribió") == "the man sees the book that the woman wrote"


@pytest.mark.parametrize("src, tgt", [
    ("el banco aprobó el crédito", "the bank approved the loan"),
    ("los bancos nuevos comprarán una casa", "the new banks will buy a house"),
    ("la mujer trabaja en el banco", "the woman works at the bank"),
    ("el hombre se sentó en el banco", "the man sat on the bench"),
    ("el banco del parque era viejo", "the park bench was old"),
    ("la niña se sienta en un banco viejo del parque", "the girl sits on an old park bench"),
])
def test_banco_is_bank_in_a_financial_context_and_bench_where_one_sits(src, tgt):
    assert english(src) == tgt


def test_carta_is_letter_alone_and_menu_in_carta_del_restaurante():
    assert english("el hombre lee la carta") == "the man reads the letter"
    pair = translate_known("el hombre lee la carta del restaurante")
    assert pair is not None and pair.tgt == "the man reads the restaurant menu"
    assert (4, 5) in pair.alignment and (6, 4) in pair.alignment and not any(i == 5 for i, _ in pair.alignment)


def test_every_spanish_sentence_has_one_translation_across_two_large_draws(draw):
    translations: dict[str, tuple] = {}
    for pair in draw + generate(10000, seed=1):
        assert translations.setdefault(pair.src, (pair.tgt, pair.alignment)) == (pair.tgt, pair.alignment)
    assert len(translations) < 30000   # the draws overlap, so sentences really were compared


def test_alignments_are_in_range_and_align_every_english_word(draw):
    for pair in draw:
        es, en = pair.src.split(), pair.tgt.split()
        assert list(pair.alignment) == sorted(set(pair.alignment))
        assert all(0 <= i < len(es) and 0 <= j < len(en) for i, j in pair.alignment)
        assert {j for _, j in pair.alignment} == set(range(len(en)))
        unaligned = set(range(len(es))) - {i for i, _ in pair.alignment}
        assert all(es[i] == "del" for i in unaligned)


def test_the_language_has_a_small_vocabulary_short_sentences_and_many_distinct_sentences(draw):
    assert len({pair.src for pair in draw}) == 20000
    assert 80 <= len({w for pair in draw for w in pair.src.split()}) <= 160
    lengths = [len(pair.src.split()) for pair in draw] + [len(pair.tgt.split()) for pair in draw]
    assert min(lengths) >= 3 and max(lengths) <= 18
    assert sum(3 <= n <= 14 for n in lengths) / len(lengths) > 0.95


def test_every_phenomenon_is_frequent_enough_to_learn(draw):
    def share(test) -> float:
        return sum(map(test, draw)) / len(draw)

    assert 0.12 <= share(lambda p: "que" in p.src.split()) <= 0.22
    assert 0.04 <= share(lambda p: "banco" in p.src or "bancos" in p.src) <= 0.10
    for word in (" bank", " bench", "park bench", " menu", " letter"):
        assert share(lambda p, word=word: word in f" {p.tgt}") >= 0.005, word
    for word in ("unos", "unas", "un", "una", "los", "las", "será", "eran", "se"):
        assert share(lambda p, word=word: word in p.src.split()) >= 0.005, word
    for word in ("will", "was", "were", "an", "some"):
        assert share(lambda p, word=word: word in p.tgt.split()) >= 0.02, word


def test_split_gives_disjoint_sets_of_the_requested_sizes():
    train, test = split(3000, 300, seed=5)
    assert len(train) == 3000 and len(test) == 300
    assert not {p.src for p in train} & {p.src for p in test}
    assert split(3000, 300, seed=5) == (train, test)


def test_write_corpus_writes_one_line_per_pair_in_each_file(tmp_path):
    pairs = generate(50, seed=2)
    paths = write_corpus(pairs, tmp_path / "corpus", "train")
    assert paths == {key: tmp_path / "corpus" / f"train.{key}" for key in ("es", "en", "align")}
    lines = {key: path.read_text(encoding="utf-8").splitlines() for key, path in paths.items()}
    assert lines["es"] == [p.src for p in pairs] and lines["en"] == [p.tgt for p in pairs]
    assert [tuple(tuple(map(int, link.split("-"))) for link in line.split()) for line in lines["align"]] \
        == [p.alignment for p in pairs]
