"""A small Spanish→English grammar that writes its own parallel corpus, with gold word alignments.

A short sentence (generate) is one clause: subject noun phrase, verb, and what the verb takes (an
object, a place after "en", or an adjective after "ser"). One noun phrase (not a place) may carry a
relative clause: "que" + verb + object (the head is the subject: "el gato que come el ratón
duerme") or "que" + subject + verb (the head is the object: "el libro que los estudiantes leían era
difícil").

A long sentence (generate_long, for measuring translation against source length, up to 60 words
and beyond) joins 1 to 4 such clauses with "y" or "pero". In each clause the subject and the object
(not a place) may both carry a relative clause, and the noun phrase inside a relative clause may
carry one of its own, three deep at most: "el libro que los estudiantes que llegaron tarde leían
era difícil" → "the book that the students that arrived late were reading was difficult". A
relative clause may also have a verb that takes nothing ("que duermen", "que llegaron tarde"), and
the long sentences add the verb "llegar" (arrive), which the adverb "tarde" or "temprano" may
follow. There is no punctuation. Every short sentence is also a long one.

The Spanish words alone decide the English:

* articles agree with the noun in gender and number: el/la/los/las → the, un/una → a/an (by the
  next English word), unos/unas → some;
* adjectives follow the noun in Spanish and precede it in English; they agree in Spanish only;
* the Spanish verb form carries tense and number: come → eats, comen → eat, comió → ate,
  comía → was eating, comían → were eating, comerá(n) → will eat; es → is, son → are,
  era → was, eran → were, será(n) → will be; llegó → arrived, llegaba → was arriving;
* everything else keeps its order: "que" → "that" starts a relative clause, whose own relative
  clauses come between it and its verb in English as in Spanish; tarde → late, temprano → early
  after the verb; y → and, pero → but between clauses;
* a noun with several senses takes the one its verb licenses, and the grammar never licenses
  two: "banco" is "bank" as subject of aprobar/comprar and where one works, "bench" where one
  sits, "park bench" in "banco del parque"; "carta" is "letter", "menu" in "carta del restaurante".

Alignment convention (0-based word indices, Spanish first; Pharaoh "i-j" in files): article →
article, noun → noun, adjective → adjective, adverb → adverb ("tarde" → "late"), conjunction →
conjunction ("y" → "and", "pero" → "but"); a verb → every word of its English verb group ("leerá"
→ "will" "read", "leían" → "were" "reading"), and the "se" of "se sentó" → the same words ("sat");
"que" → "that"; "en" → "on"/"at". In a compound ("banco del parque" → "park bench") the modifier
aligns to the modifier and "del" stays unaligned, English marking the relation by word order alone.
Every English word is aligned; "del" is the only Spanish word never aligned.

generate() draws short pairs and generate_long() pairs whose lengths spread evenly over a range;
split() and split_long() make disjoint train/test sets of each, write_corpus() writes .es/.en/.align
files, and translate_known() parses a Spanish sentence, short or long, back into the grammar (None
if it is not one).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict, deque
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import AtencionError
from ..fileio import atomic_write_text

TENSES = ("present", "preterite", "imperfect", "future")


@dataclass(frozen=True)
class Noun:
    """A noun sense: (singular, plural) in each language, gender, the semantic kind that verbs and
    adjectives select, and the "del X" modifier (Spanish, English) that makes it a compound."""

    es: tuple[str, str]
    en: tuple[str, str]
    feminine: bool
    kind: str
    modifier: tuple[str, str] | None = None


def _noun(es: str, en: str, gender: str, kind: str, modifier: tuple[str, str] | None = None) -> Noun:
    return Noun(tuple(es.split()), tuple(en.split()), gender == "f", kind, modifier)


NOUNS: dict[str, Noun] = {
    "cat": _noun("gato gatos", "cat cats", "m", "animal"),
    "dog": _noun("perro perros", "dog dogs", "m", "animal"),
    "mouse": _noun("ratón ratones", "mouse mice", "m", "animal"),
    "man": _noun("hombre hombres", "man men", "m", "person"),
    "woman": _noun("mujer mujeres", "woman women", "f", "person"),
    "boy": _noun("niño niños", "boy boys", "m", "person"),
    "girl": _noun("niña niñas", "girl girls", "f", "person"),
    "student": _noun("estudiante estudiantes", "student students", "m", "person"),
    "book": _noun("libro libros", "book books", "m", "text"),
    "letter": _noun("carta cartas", "letter letters", "f", "text"),
    "house": _noun("casa casas", "house houses", "f", "thing"),
    "apple": _noun("manzana manzanas", "apple apples", "f", "thing"),
    "table": _noun("mesa mesas", "table tables", "f", "thing"),
    "bank": _noun("banco bancos", "bank banks", "m", "bank"),
    "bench": _noun("banco bancos", "bench benches", "m", "bench"),
    "park_bench": _noun("banco bancos", "bench benches", "m", "park_bench", ("parque", "park")),
    "menu": _noun("carta cartas", "menu menus", "f", "menu", ("restaurante", "restaurant")),
    "loan": _noun("crédito créditos", "loan loans", "m", "loan"),
}


def _nouns(spec: str) -> tuple[str, ...]:
    """The noun senses whose key or kind `spec` names: a selectional restriction."""
    names = spec.split()
    return tuple(key for key, noun in NOUNS.items() if key in names or noun.kind in names)


@dataclass(frozen=True)
class Adjective:
    """Spanish forms (m sg, f sg, m pl, f pl), the one English form, the nouns it may describe."""

    es: tuple[str, str, str, str]
    en: str
    fits: tuple[str, ...]


def _adjective(lemma: str, en: str, fits: str) -> Adjective:
    """Spanish agreement: -o inflects -o/-a/-os/-as; other adjectives have one form for both
    genders and take -s after a vowel, -es after a consonant, with z → c (feliz → felices)."""
    if lemma.endswith("o"):
        return Adjective((lemma, lemma[:-1] + "a", lemma + "s", lemma[:-1] + "as"), en, _nouns(fits))
    plural = lemma[:-1] + "ces" if lemma.endswith("z") else lemma + ("s" if lemma[-1] in "aeiou" else "es")
    return Adjective((lemma, lemma, plural, plural), en, _nouns(fits))


_ANYTHING = "animal person text thing bank bench park_bench menu loan"
ADJECTIVES: dict[str, Adjective] = {
    "negro": _adjective("negro", "black", "animal thing text bench park_bench"),
    "blanco": _adjective("blanco", "white", "animal thing text bench park_bench"),
    "grande": _adjective("grande", "big", _ANYTHING),
    "viejo": _adjective("viejo", "old", _ANYTHING),
    "nuevo": _adjective("nuevo", "new", _ANYTHING.replace("animal", "")),
    "alto": _adjective("alto", "tall", "animal person"),
    "feliz": _adjective("feliz", "happy", "animal person"),
    "difícil": _adjective("difícil", "difficult", "text"),
    "fácil": _adjective("fácil", "easy", "text"),
}
_ADJECTIVES_FOR = {key: [a for a, adj in ADJECTIVES.items() if key in adj.fits] for key in NOUNS}


@dataclass(frozen=True)
class Verb:
    """Spanish forms, (singular, plural) per tense in TENSES order; English base, -s, past, -ing;
    the noun senses it takes as subject and as complement; whether it is reflexive ("se"); the
    preposition (Spanish, English) before a place complement; the adverbs that may follow it."""

    es: tuple[str, ...]
    en: tuple[str, ...]
    subjects: tuple[str, ...]
    complements: tuple[str, ...] = ()
    tenses: tuple[str, ...] = TENSES
    reflexive: bool = False
    prep: tuple[str, str] | None = None
    adverbs: tuple[str, ...] = ()

    @property
    def transitive(self) -> bool:
        return bool(self.complements) and self.prep is None

    @property
    def intransitive(self) -> bool:
        """Takes nothing after it: no object, no place, not the adjective of "ser"."""
        return not self.complements and self.en[0] != "be"

    def english(self, tense: str, plural: bool) -> list[str]:
        """-s only in the singular present; was/were + -ing for the imperfect; will + base for the
        future. "ser": is/are, was/were, will be."""
        base, third, past, ing = self.en
        if base == "be":
            return {"present": ["are" if plural else "is"], "imperfect": ["were" if plural else "was"],
                    "future": ["will", "be"]}[tense]
        return {"present": [base if plural else third], "preterite": [past],
                "imperfect": ["were" if plural else "was", ing], "future": ["will", base]}[tense]


def _verb(es: str, en: str, subjects: str, complements: str = "", **kw) -> Verb:
    return Verb(tuple(es.split()), tuple(en.split()), _nouns(subjects), _nouns(complements), **kw)


VERBS: dict[str, Verb] = {
    "comer": _verb("come comen comió comieron comía comían comerá comerán", "eat eats ate eating",
                   "animal person", "mouse apple"),
    "ver": _verb("ve ven vio vieron veía veían verá verán", "see sees saw seeing",
                 "animal person", "animal person text thing"),
    "leer": _verb("lee leen leyó leyeron leía leían leerá leerán", "read reads read reading",
                  "person", "text menu"),
    "escribir": _verb("escribe escriben escribió escribieron escribía escribían escribirá escribirán",
                      "write writes wrote writing", "person", "text"),
    "comprar": _verb("compra compran compró compraron compraba compraban comprará comprarán",
                     "buy buys bought buying", "person bank", "thing book"),
    "aprobar": _verb("aprueba aprueban aprobó aprobaron aprobaba aprobaban aprobará aprobarán",
                     "approve approves approved approving", "bank", "loan"),
    "dormir": _verb("duerme duermen durmió durmieron dormía dormían dormirá dormirán",
                    "sleep sleeps slept sleeping", "animal person"),
    "sentarse": _verb("sienta sientan sentó sentaron sentaba sentaban sentará sentarán",
                      "sit sits sat sitting", "animal person", "table bench park_bench",
                      reflexive=True, prep=("en", "on")),
    "trabajar": _verb("trabaja trabajan trabajó trabajaron trabajaba trabajaban trabajará trabajarán",
                      "work works worked working", "person", "bank", prep=("en", "at")),
    "ser": _verb("es son fue fueron era eran será serán", "be is was being",
                 "animal person text thing park_bench menu", tenses=("present", "imperfect", "future")),
    # Only the long sentences use "llegar": generate() draws its verbs by VERB_WEIGHTS, and its
    # relative clauses take transitive verbs only.
    "llegar": _verb("llega llegan llegó llegaron llegaba llegaban llegará llegarán",
                    "arrive arrives arrived arriving", "animal person", adverbs=("tarde", "temprano")),
}
ADVERBS = {"tarde": "late", "temprano": "early"}
CONJUNCTIONS = {"y": "and", "pero": "but"}
ARTICLES = {True: ("el", "la", "los", "las"), False: ("un", "una", "unos", "unas")}

# How often each verb heads a sentence: simple clauses dominate; with P_RELATIVE, about 18% of
# a deduplicated draw has a relative clause and 8% has "banco".
VERB_WEIGHTS = {"comer": 14, "ver": 12, "leer": 10, "escribir": 6, "comprar": 6, "aprobar": 1.2,
                "dormir": 8, "sentarse": 2.4, "trabajar": 1, "ser": 18}
P_DEFINITE, P_PLURAL, P_ADJECTIVE, P_RELATIVE, P_OBJECT_RELATIVE = 0.7, 0.4, 0.4, 0.14, 0.35


@dataclass(frozen=True)
class Rel:
    """A relative clause on a head noun: its verb and tense, the verb's other argument (None for an
    intransitive verb, whose subject is the head), and an adverb after the verb."""

    verb: str
    tense: str
    other: NP | None
    head_is_subject: bool
    adv: str | None = None


@dataclass(frozen=True)
class NP:
    """A noun phrase: noun sense, number, article, optional adjective and relative clause."""

    noun: str
    plural: bool
    definite: bool
    adj: str | None = None
    rel: Rel | None = None


@dataclass(frozen=True)
class Clause:
    """A clause: subject, verb, tense, and an object or place, or (for "ser") an adjective, and an
    adverb after the verb ("llegó tarde")."""

    subject: NP
    verb: str
    tense: str
    complement: NP | None = None
    adj: str | None = None
    adv: str | None = None


@dataclass(frozen=True)
class Sentence:
    """Clauses joined by conjunctions: conjunctions[i] ("y" or "pero") comes before clauses[i + 1]."""

    clauses: tuple[Clause, ...]
    conjunctions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Pair:
    """A Spanish sentence, its English translation, and their sorted word alignment."""

    src: str
    tgt: str
    alignment: tuple[tuple[int, int], ...]


class _Bitext:
    """Spanish and English words written side by side, each English word linked to its sources."""

    def __init__(self) -> None:
        self.es: list[str] = []
        self.en: list[str] = []
        self.links: list[tuple[int, int]] = []

    def es_word(self, word: str) -> int:
        self.es.append(word)
        return len(self.es) - 1

    def en_words(self, words: list[str], *sources: int) -> None:
        for word in words:
            self.links += [(i, len(self.en)) for i in sources]
            self.en.append(word)

    def word(self, es: str, en: str) -> None:
        """One Spanish word translated by one English word: a conjunction, an adverb."""
        self.en_words([en], self.es_word(es))

    def noun_phrase(self, np: NP) -> None:
        """det N [adj] [del M] [rel] → det [adj] [M] N [rel], with a → an before a vowel."""
        noun, adj, index = NOUNS[np.noun], ADJECTIVES.get(np.adj), 2 * np.plural + NOUNS[np.noun].feminine
        det, head = self.es_word(ARTICLES[np.definite][index]), self.es_word(noun.es[np.plural])
        before_noun = [(adj.en, self.es_word(adj.es[index]))] if adj else []
        if noun.modifier:
            self.es_word("del")
            before_noun.append((noun.modifier[1], self.es_word(noun.modifier[0])))
        first = before_noun[0][0] if before_noun else noun.en[np.plural]
        article = "the" if np.definite else "some" if np.plural else "an" if first[0] in "aeiou" else "a"
        self.en_words([article], det)
        for word, source in before_noun:
            self.en_words([word], source)
        self.en_words([noun.en[np.plural]], head)
        if np.rel:
            self.relative(np.rel, np.plural)

    def relative(self, rel: Rel, head_plural: bool) -> None:
        """que V [object] [adv] or que subject V: the words keep their order in English. The
        argument may carry a relative clause of its own, which then comes between "que" and V."""
        self.word("que", "that")
        if rel.head_is_subject:
            self.verb(rel.verb, rel.tense, head_plural)
            if rel.other:
                self.noun_phrase(rel.other)
        else:
            self.noun_phrase(rel.other)
            self.verb(rel.verb, rel.tense, rel.other.plural)
        if rel.adv:
            self.word(rel.adv, ADVERBS[rel.adv])

    def verb(self, key: str, tense: str, plural: bool) -> None:
        """The verb agrees with its subject in number; "se" comes before a reflexive one."""
        verb = VERBS[key]
        sources = [self.es_word("se")] if verb.reflexive else []
        sources.append(self.es_word(verb.es[2 * TENSES.index(tense) + plural]))
        self.en_words(verb.english(tense, plural), *sources)

    def clause(self, clause: Clause) -> None:
        subject = clause.subject
        self.noun_phrase(subject)
        self.verb(clause.verb, clause.tense, subject.plural)
        if clause.adj:
            adj = ADJECTIVES[clause.adj]
            self.word(adj.es[2 * subject.plural + NOUNS[subject.noun].feminine], adj.en)
        if clause.complement:
            prep = VERBS[clause.verb].prep
            if prep:
                self.word(*prep)
            self.noun_phrase(clause.complement)
        if clause.adv:
            self.word(clause.adv, ADVERBS[clause.adv])


def realise(sentence: Clause | Sentence) -> Pair:
    """The Spanish sentence, its English translation and their alignment."""
    if isinstance(sentence, Clause):
        sentence = Sentence((sentence,))
    b = _Bitext()
    b.clause(sentence.clauses[0])
    for conjunction, clause in zip(sentence.conjunctions, sentence.clauses[1:]):
        b.word(conjunction, CONJUNCTIONS[conjunction])
        b.clause(clause)
    return Pair(" ".join(b.es), " ".join(b.en), tuple(sorted(b.links)))


def _draw_np(rng: random.Random, nouns: tuple[str, ...]) -> NP:
    """A noun phrase on one of `nouns`, with an adjective that may describe it."""
    noun = rng.choice(nouns)
    adjs = _ADJECTIVES_FOR[noun]
    adj = rng.choice(adjs) if adjs and rng.random() < P_ADJECTIVE else None
    return NP(noun, rng.random() < P_PLURAL, rng.random() < P_DEFINITE, adj)


def _relative_options(noun: str, intransitive: bool = False) -> list[tuple[str, bool]]:
    """(verb, head is its subject) for each relative clause that may describe `noun`: a transitive
    verb that licenses it as subject or object, and, if `intransitive`, a verb that takes nothing."""
    options = [(key, is_subject) for key, v in VERBS.items() if v.transitive
               for is_subject, role in ((True, v.subjects), (False, v.complements)) if noun in role]
    return options + [(key, True) for key, v in VERBS.items() if intransitive and v.intransitive and noun in v.subjects]


def _with_relative(rng: random.Random, head: NP) -> NP:
    """Attach a relative clause whose verb licenses the head as its subject or its object."""
    options = _relative_options(head.noun)
    if not options:
        return head
    key, is_subject = rng.choice(options)
    verb = VERBS[key]
    other = _draw_np(rng, verb.complements if is_subject else verb.subjects)
    return replace(head, rel=Rel(key, rng.choice(verb.tenses), other, is_subject))


def _draw_clause(rng: random.Random) -> Clause:
    """A verb by VERB_WEIGHTS, arguments it licenses, and now and then a relative clause."""
    key = rng.choices(list(VERB_WEIGHTS), weights=list(VERB_WEIGHTS.values()))[0]
    verb = VERBS[key]
    subject = _draw_np(rng, verb.subjects)
    complement = _draw_np(rng, verb.complements) if verb.complements else None
    adj = rng.choice([a for a in _ADJECTIVES_FOR[subject.noun] if a != subject.adj]) if key == "ser" else None
    if rng.random() < P_RELATIVE:
        if verb.transitive and rng.random() < P_OBJECT_RELATIVE:
            complement = _with_relative(rng, complement)
        else:
            subject = _with_relative(rng, subject)
    return Clause(subject, key, rng.choice(verb.tenses), complement, adj)


def generate(n: int, seed: int = 0) -> list[Pair]:
    """n pairs drawn with random.Random(seed); their Spanish is distinct while the grammar allows
    (after 50·n draws it repeats sentences rather than loop for ever)."""
    rng, seen, pairs, draws = random.Random(seed), set(), [], 0
    while len(pairs) < n:
        pair, draws = realise(_draw_clause(rng)), draws + 1
        if pair.src not in seen or draws > 50 * n:
            seen.add(pair.src)
            pairs.append(pair)
    return pairs


def split(n_train: int, n_test: int, seed: int = 0) -> tuple[list[Pair], list[Pair]]:
    """Disjoint train and held-out test sets (no Spanish sentence in both), drawn together then
    shuffled so that both follow the same distribution."""
    pairs = generate(n_train + n_test, seed)
    random.Random(f"split {seed}").shuffle(pairs)
    train, test = pairs[:n_train], pairs[n_train:]
    if {p.src for p in train} & {p.src for p in test}:
        raise AtencionError(f"the grammar has fewer than {n_train + n_test} distinct sentences")
    return train, test


# The long sentences: 1 to MAX_CLAUSES clauses joined by "y" or (P_BUT) "pero", and relative
# clauses nested up to MAX_DEPTH deep. "llegar" joins the verbs; P_ADVERB of its uses take one.
LONG_VERB_WEIGHTS = {**VERB_WEIGHTS, "llegar": 8}
MAX_CLAUSES, MAX_DEPTH, P_BUT, P_ADVERB = 4, 3, 0.25, 0.5


def _draw_long_np(rng: random.Random, nouns: tuple[str, ...], p_relative: float, depth: int = 0) -> NP:
    """A noun phrase that, with probability p_relative, carries a relative clause (depth counts
    the relative clauses it already sits in)."""
    np = _draw_np(rng, nouns)
    options = _relative_options(np.noun, intransitive=True)
    if depth == MAX_DEPTH or not options or rng.random() >= p_relative:
        return np
    key, is_subject = rng.choice(options)
    verb = VERBS[key]
    other = None if verb.intransitive else \
        _draw_long_np(rng, verb.complements if is_subject else verb.subjects, p_relative, depth + 1)
    adv = rng.choice(verb.adverbs) if verb.adverbs and rng.random() < P_ADVERB else None
    return replace(np, rel=Rel(key, rng.choice(verb.tenses), other, is_subject, adv))


def _draw_long_clause(rng: random.Random, p_relative: float) -> Clause:
    """A clause by LONG_VERB_WEIGHTS whose subject and object (not a place) may each carry a
    relative clause."""
    key = rng.choices(list(LONG_VERB_WEIGHTS), weights=list(LONG_VERB_WEIGHTS.values()))[0]
    verb = VERBS[key]
    subject = _draw_long_np(rng, verb.subjects, p_relative)
    complement = None
    if verb.transitive:
        complement = _draw_long_np(rng, verb.complements, p_relative)
    elif verb.complements:
        complement = _draw_np(rng, verb.complements)
    adj = rng.choice([a for a in _ADJECTIVES_FOR[subject.noun] if a != subject.adj]) if key == "ser" else None
    adv = rng.choice(verb.adverbs) if verb.adverbs and rng.random() < P_ADVERB else None
    return Clause(subject, key, rng.choice(verb.tenses), complement, adj, adv)


def _draw_sentence(rng: random.Random, words: int) -> Sentence:
    """Clauses aimed at about `words` Spanish words in all. A clause is 5 words on average without
    relative clauses and 18 with p_relative 0.9 (up to about 40): so a number of clauses that
    leaves each 5 to 18 words, and p_relative interpolated between those two points."""
    fewest = min(MAX_CLAUSES, math.ceil((words + 1) / 19))
    k = rng.randint(fewest, max(fewest, min(MAX_CLAUSES, (words + 1) // 6)))
    per_clause = (words + 1) / k - 1   # the k - 1 conjunctions take a word each
    p_relative = min(0.9, max(0.0, (per_clause - 5) / 13 * 0.9))
    clauses = tuple(_draw_long_clause(rng, p_relative) for _ in range(k))
    return Sentence(clauses, tuple("pero" if rng.random() < P_BUT else "y" for _ in clauses[1:]))


def generate_long(n: int, seed: int = 0, min_words: int = 5, max_words: int = 60) -> list[Pair]:
    """n distinct pairs drawn with random.Random(seed) whose Spanish lengths (in words) are spread
    uniformly over [min_words, max_words]. Each pair draws its length uniformly and takes the
    oldest unused sentence of that length; if there is none, sentences aimed at that length
    (_draw_sentence) are drawn until one has it, and the new ones of other lengths in the range
    are kept for later pairs, so that few draws are wasted. Raises AtencionError when 10,000
    sentences aimed at a length bring no new one of it (the grammar has too few that short)."""
    if not 3 <= min_words <= max_words:
        raise AtencionError(f"generate_long needs 3 <= min_words <= max_words, not {min_words} and {max_words}")
    rng, seen, pairs = random.Random(seed), set(), []
    unused: dict[int, deque[Pair]] = defaultdict(deque)   # Spanish length → pairs in drawing order
    while len(pairs) < n:
        words, misses = rng.randint(min_words, max_words), 0
        while not unused[words]:
            if misses == 10_000:
                raise AtencionError(f"the grammar makes too few distinct sentences of {words} words")
            pair, misses = realise(_draw_sentence(rng, words)), misses + 1
            length = len(pair.src.split())
            if min_words <= length <= max_words and pair.src not in seen:
                seen.add(pair.src)
                unused[length].append(pair)
        pairs.append(unused[words].popleft())
    return pairs


def split_long(n_train: int, n_test: int, seed: int = 0, min_words: int = 5,
               max_words: int = 60) -> tuple[list[Pair], list[Pair]]:
    """split() for generate_long(): disjoint train and test sets with the same spread of lengths."""
    pairs = generate_long(n_train + n_test, seed, min_words, max_words)
    random.Random(f"split_long {seed}").shuffle(pairs)
    return pairs[:n_train], pairs[n_train:]


def write_corpus(pairs: list[Pair], directory: str | Path, prefix: str) -> dict[str, Path]:
    """Write {prefix}.es, {prefix}.en and {prefix}.align (Pharaoh 'i-j'), one pair a line, UTF-8."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    columns = {"es": [p.src for p in pairs], "en": [p.tgt for p in pairs],
               "align": [" ".join(f"{i}-{j}" for i, j in p.alignment) for p in pairs]}
    paths = {key: directory / f"{prefix}.{key}" for key in columns}
    for key, lines in columns.items():
        atomic_write_text(paths[key], "".join(line + "\n" for line in lines))
    return paths


_DETERMINERS = {form: definite for definite, forms in ARTICLES.items() for form in forms}
_NOUN_FORMS: dict[str, tuple[list[str], bool]] = {}   # Spanish form → (its senses, plural)
for _key, _noun_sense in NOUNS.items():
    for _plural, _form in enumerate(_noun_sense.es if not _noun_sense.modifier else ()):
        _NOUN_FORMS.setdefault(_form, ([], bool(_plural)))[0].append(_key)
_COMPOUNDS = {(n.es[0], n.modifier[0]): key for key, n in NOUNS.items() if n.modifier}
_ADJECTIVE_FORMS = {form: key for key, adj in ADJECTIVES.items() for form in adj.es}
_VERB_FORMS = {form: (key, TENSES[i // 2]) for key, v in VERBS.items() for i, form in enumerate(v.es)}


class _NoParse(Exception):
    """The words are not a sentence of the grammar."""


class _Parser:
    """Recursive descent over the sentence shapes above. It reads lemmas and ignores agreement:
    translate_known realises the parse again and requires the same Spanish words back. A "que"
    describes the nearest noun, and an adverb goes with the nearest verb: the only readings the
    grammar allows, as a noun phrase carries one relative clause and only "llegar" takes adverbs."""

    def __init__(self, words: list[str]) -> None:
        self.words, self.i = words, 0

    def peek(self) -> str | None:
        return self.words[self.i] if self.i < len(self.words) else None

    def take(self, table: dict):
        if self.peek() not in table:
            raise _NoParse
        self.i += 1
        return table[self.words[self.i - 1]]

    def adverb(self) -> str | None:
        return self.take({adv: adv for adv in ADVERBS}) if self.peek() in ADVERBS else None

    def noun_phrase(self, licensed: tuple[str, ...] = (), relative: bool = True) -> NP:
        definite = self.take(_DETERMINERS)
        senses, plural = self.take(_NOUN_FORMS)
        noun = next((s for s in senses if s in licensed), senses[0])   # the sense the verb licenses
        adj = self.take(_ADJECTIVE_FORMS) if self.peek() in _ADJECTIVE_FORMS else None
        if self.peek() == "del":
            self.i += 1
            noun = self.take({m: key for (head, m), key in _COMPOUNDS.items() if head == NOUNS[noun].es[0]})
        rel = None
        if relative and self.peek() == "que":
            self.i += 1
            if self.peek() in _DETERMINERS:   # que + subject + verb: the head is the object
                other = self.noun_phrase()
                rel = Rel(*self.take(_VERB_FORMS), other, head_is_subject=False)
            else:                             # que + verb [+ object] [+ adverb]: the head is the subject
                verb, tense = self.take(_VERB_FORMS)
                other = self.noun_phrase(VERBS[verb].complements) if VERBS[verb].transitive else None
                rel = Rel(verb, tense, other, True, self.adverb())
        return NP(noun, plural, definite, adj, rel)

    def clause(self) -> Clause:
        subject = self.noun_phrase()
        if self.peek() == "se":   # that its verb is reflexive, the re-realisation checks
            self.i += 1
        key, tense = self.take(_VERB_FORMS)
        verb, adj, complement = VERBS[key], None, None
        if key == "ser":
            adj = self.take(_ADJECTIVE_FORMS)
        elif verb.complements:
            if verb.prep:
                self.take({verb.prep[0]: None})
            complement = self.noun_phrase(verb.complements, relative=verb.prep is None)
        return Clause(subject, key, tense, complement, adj, self.adverb())

    def sentence(self) -> Sentence:
        clauses, conjunctions = [self.clause()], []
        while self.peek() is not None:
            conjunctions.append(self.take({c: c for c in CONJUNCTIONS}))
            clauses.append(self.clause())
        return Sentence(tuple(clauses), tuple(conjunctions))


def _fits(np: NP, depth: int = 0) -> bool:
    """The adjective may describe the noun; the relative clause's verb licenses head and argument
    and takes its adverb; relative clauses nest at most MAX_DEPTH deep (depth: how deep np is)."""
    if np.adj and np.noun not in ADJECTIVES[np.adj].fits:
        return False
    if np.rel is None:
        return True
    rel, verb = np.rel, VERBS[np.rel.verb]
    if depth == MAX_DEPTH or rel.tense not in verb.tenses or rel.adv not in (None, *verb.adverbs):
        return False
    if rel.other is None:
        return verb.intransitive and np.noun in verb.subjects
    roles = (verb.subjects, verb.complements)
    head_role, other_role = roles if rel.head_is_subject else roles[::-1]
    return verb.transitive and np.noun in head_role and rel.other.noun in other_role and _fits(rel.other, depth + 1)


def _licensed(c: Clause) -> bool:
    """Whether _draw_long_clause can draw the clause: the restrictions of the tables above."""
    verb = VERBS[c.verb]
    if c.verb == "ser":
        predicate_ok = c.adj != c.subject.adj and c.subject.noun in ADJECTIVES[c.adj].fits
    elif verb.complements:
        predicate_ok = c.complement is not None and c.complement.noun in verb.complements and _fits(c.complement)
    else:
        predicate_ok = c.complement is None
    return (c.tense in verb.tenses and c.subject.noun in verb.subjects and _fits(c.subject)
            and predicate_ok and c.adv in (None, *verb.adverbs))


def translate_known(src: str) -> Pair | None:
    """The grammar's translation of a Spanish sentence, short or long, or None if the grammar
    cannot produce it."""
    try:
        sentence = _Parser(src.split()).sentence()
    except _NoParse:
        return None
    licensed = len(sentence.clauses) <= MAX_CLAUSES and all(map(_licensed, sentence.clauses))
    pair = realise(sentence) if licensed else None
    return pair if pair is not None and pair.src == src else None
