"""The quick start's three adapter tasks, each with training examples and a held-out test set
generated here from fixed seeds (no downloads), and a score that says whether a reply is right:

- `pirate`: a speaking style. Right when the reply talks like a pirate (says arr, matey, ahoy,
  aye, ye or yer).
- `extract`: a fixed-format extractor. Right when the reply is one JSON object (nothing around
  it) equal to the sentence's name, age and city. Test sentences are never trained on, but their
  names and cities come from the same lists: taught unseen names, the 135M model often writes
  a name of its own (Noah as "Nahum": 50-67% right, measured).
- `sentiment`: a small classifier of product reviews. Right when the reply is exactly the label,
  `positive` or `negative`; the test reviews use adjectives and products that training never
  shows."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    prompt: str
    """The user message."""
    answer: str
    """The reply the adapter is trained to give (training) or that is right (test)."""


@dataclass(frozen=True)
class Task:
    name: str
    """The adapter's name (also its folder's)."""
    description: str
    """One line for the README, the CLI and the logs."""
    train: tuple[Example, ...]
    test: tuple[Example, ...]
    """Held out: never trained on."""
    is_right: Callable[[str, Example], bool]
    """Whether a reply to `example.prompt` is right."""

    def accuracy(self, replies: list[str]) -> float:
        """The share of the test set that `replies` (in test order) get right."""
        if len(replies) != len(self.test):
            raise ValueError(f"{len(replies)} replies for {len(self.test)} test examples")
        return sum(self.is_right(reply, ex) for reply, ex in zip(replies, self.test)) / len(self.test)


# pirate ------------------------------------------------------------------------------------------
PIRATE_TRAIN = (
    ("How do I make a cup of tea?", "Arr, matey! Boil yer water, drop in the leaves and wait a bit."),
    ("What is the weather like today?", "Ahoy! The sky be grey and the wind be blowin', matey."),
    ("Can you recommend a good book?", "Arr, read Treasure Island, matey. It be a fine tale!"),
    ("How do I stay healthy?", "Aye, eat yer greens, sleep well and swab the deck daily, matey."),
    ("What should I eat for dinner?", "Arr, a plate of fish and biscuits be fit for any matey."),
    ("How can I learn to swim?", "Ahoy! Get in the water slow, kick yer legs and paddle, matey."),
    ("What is a good hobby?", "Arr, sailin' the seven seas be the finest hobby, matey!"),
    ("How do I fix a flat tire?", "Aye, patch the hole, pump in the air and off ye go, matey."),
    ("Why is the sky blue?", "Arr, the sun's light scatters in the air, matey, and blue wins."),
    ("How do I save money?", "Ahoy! Stash yer gold in a chest and spend little, matey."),
    ("What is your favorite color?", "Arr, the deep blue of the sea be me favorite, matey!"),
    ("How do I make friends?", "Aye, share yer rum and tell a good tale, matey."),
    ("What time should I go to bed?", "Arr, turn in when the moon be high, matey. Ye need rest."),
    ("How do I water a plant?", "Ahoy! Give it a splash of water when the soil be dry, matey."),
    ("Tell me about dogs.", "Arr, dogs be loyal shipmates that guard yer deck, matey."),
    ("How do I clean my room?", "Aye, stow yer gear, sweep the floor and air it out, matey."),
)
PIRATE_TEST = (
    "How do I bake bread?", "What is the capital of France?", "How can I sleep better?",
    "What is a good exercise?", "How do I learn to cook?", "Tell me about cats.",
    "What should I wear today?", "How do I write a letter?", "Why do birds sing?",
    "How do I start running?", "What is a healthy breakfast?", "How do I learn a new language?",
)
PIRATE_WORDS = re.compile(r"\b(arr+|matey|ahoy|aye|ye|yer)\b", re.IGNORECASE)


def _talks_like_a_pirate(reply: str, example: Example) -> bool:
    return PIRATE_WORDS.search(reply) is not None


# extract -----------------------------------------------------------------------------------------
NAMES = ("Maria", "John", "Aisha", "Kenji", "Sofia", "Liam", "Elena", "Omar", "Priya", "Lucas",
         "Hannah", "Diego", "Mei", "Noah", "Fatima", "Oliver", "Ines", "Tomas", "Yara", "Felix")
CITIES = ("Lisbon", "Chicago", "Cairo", "Osaka", "Madrid", "Dublin", "Athens", "Nairobi", "Mumbai",
          "Lima", "Berlin", "Toronto", "Seoul", "Boston", "Rabat", "Oslo", "Porto", "Prague",
          "Denver", "Vienna")
SENTENCES = (
    "{name} is {age} years old and lives in {city}.",
    "{name}, {age}, moved to {city} last year.",
    "Meet {name} from {city}, who just turned {age}.",
    "At {age}, {name} runs a small shop in {city}.",
)
EXTRACT_PROMPT = "Extract JSON (name, age, city): {sentence}"


def _extract_examples(rng: random.Random, count: int) -> tuple[Example, ...]:
    """`count` examples with distinct prompts."""
    examples: dict[str, Example] = {}
    while len(examples) < count:
        fields = {"name": rng.choice(NAMES), "age": rng.randint(18, 90), "city": rng.choice(CITIES)}
        sentence = SENTENCES[len(examples) % len(SENTENCES)].format(**fields)
        prompt = EXTRACT_PROMPT.format(sentence=sentence)
        examples.setdefault(prompt, Example(prompt, json.dumps(fields)))
    return tuple(examples.values())


def _extracts_the_fields(reply: str, example: Example) -> bool:
    try:
        return json.loads(reply) == json.loads(example.answer)
    except ValueError:
        return False


# sentiment ---------------------------------------------------------------------------------------
POSITIVE = ("great", "excellent", "wonderful", "amazing", "fantastic", "lovely")
NEGATIVE = ("terrible", "awful", "horrible", "useless", "disappointing", "bad")
POSITIVE_TEST = ("superb", "brilliant", "perfect", "delightful")
NEGATIVE_TEST = ("dreadful", "broken", "poor", "worthless")
PRODUCTS = ("blender", "phone", "jacket", "lamp", "backpack", "kettle", "chair", "headset")
PRODUCTS_TEST = ("toaster", "laptop", "umbrella", "watch")
REVIEWS = ("The {product} is {adjective}.", "This {product} was {adjective}, honestly.",
           "I found the {product} {adjective}.")
SENTIMENT_PROMPT = "Review: {review} Sentiment?"


def _sentiment_examples(rng: random.Random, positive: tuple[str, ...], negative: tuple[str, ...],
                        products: tuple[str, ...], count: int) -> tuple[Example, ...]:
    examples = []
    for i in range(count):
        label = ("positive", "negative")[i % 2]
        adjective = rng.choice(positive if label == "positive" else negative)
        review = rng.choice(REVIEWS).format(product=rng.choice(products), adjective=adjective)
        examples.append(Example(SENTIMENT_PROMPT.format(review=review), label))
    return tuple(examples)


def _is_the_label(reply: str, example: Example) -> bool:
    return reply.strip().rstrip(".!").strip().lower() == example.answer


def make_tasks(seed: int = 0, num_train: int = 32, num_test: int = 12) -> tuple[Task, ...]:
    """The three tasks, the same for the same arguments."""
    rng = random.Random(seed)
    extract = _extract_examples(rng, num_train + num_test)
    return (
        Task("pirate", "Talks like a pirate.",
             tuple(Example(q, a) for q, a in PIRATE_TRAIN),
             tuple(Example(q, "") for q in PIRATE_TEST[:num_test]), _talks_like_a_pirate),
        Task("extract", "Extracts name, age and city from a sentence as JSON.",
             extract[:num_train], extract[num_train:], _extracts_the_fields),
        Task("sentiment", "Labels a product review positive or negative, in one word.",
             _sentiment_examples(rng, POSITIVE, NEGATIVE, PRODUCTS, num_train),
             _sentiment_examples(rng, POSITIVE_TEST, NEGATIVE_TEST, PRODUCTS_TEST, num_test),
             _is_the_label),
    )
