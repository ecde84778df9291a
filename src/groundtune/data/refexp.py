"""The language of referring expressions: what ``data refgen`` writes and ``data check --refs``
reads back.

Both sides read this module and only this one from each other: refgen.py (the generator) writes
its phrases with these words and templates, and refcheck.py (the checker, which must not trust the
generator) reads them back with its own grammar, knowing from here only the names a category is
said by, their plurals, and the numbers that say what "clearly" means. How each side decides
stays its own: the generator's margins of safety (MAX_COVERED, BAND_SHARE) in refgen.py, the
checker's (MAX_IOU, EDGE_SHARE) in refcheck.py, so a slip in either rule shows as a disagreement
rather than being shared by both.
"""

from __future__ import annotations

# What "clearly" means, as fractions of the image's shorter side so a phrase means the same at any
# resolution. refcheck.py reads these same numbers (the definition of the language), not refgen's code.
MARGIN_FRAC = 0.04  # edges/centres this far apart are clearly apart (synth's own margin is 0.045)
SIZE_RATIO = 1.5  # "the biggest cup": at least this many times the area of every other cup
NEAR_FRAC = 0.05  # "next to": the boxes' gap at most this
FAR_FRAC = 0.15  # ... and every other box of the category's gap more than this
# --min-size's default (sqrt of the area, px), and the size under which a box is never counted for
# an extreme or an ordinal whatever --min-size says: a 15 px bottle in a corner of a 640 px photo is
# one a reader may overlook (refcheck.py reads boxes under it as ones a reader may or may not count).
MIN_SIZE_PX = 16.0

# COCO's 80 categories as people say them: the first name is the category's own, the others are
# synonyms that name no other COCO category ("bag" would also name a backpack or a suitcase).
# A category not listed (a user's own label) is said as it is written.
SYNONYMS: dict[str, tuple[str, ...]] = {
    "person": ("person",), "bicycle": ("bicycle", "bike"), "car": ("car",),
    "motorcycle": ("motorcycle", "motorbike"), "airplane": ("airplane", "plane"), "bus": ("bus",),
    "train": ("train",), "truck": ("truck",), "boat": ("boat",), "traffic light": ("traffic light",),
    "fire hydrant": ("fire hydrant", "hydrant"), "stop sign": ("stop sign",), "parking meter": ("parking meter",),
    "bench": ("bench",), "bird": ("bird",), "cat": ("cat",), "dog": ("dog",), "horse": ("horse",),
    "sheep": ("sheep",), "cow": ("cow",), "elephant": ("elephant",), "bear": ("bear",), "zebra": ("zebra",),
    "giraffe": ("giraffe",), "backpack": ("backpack", "rucksack"), "umbrella": ("umbrella",),
    "handbag": ("handbag", "purse"), "tie": ("tie",), "suitcase": ("suitcase",), "frisbee": ("frisbee",),
    "skis": ("pair of skis",), "snowboard": ("snowboard",), "sports ball": ("ball",), "kite": ("kite",),
    "baseball bat": ("baseball bat", "bat"), "baseball glove": ("baseball glove", "glove"),
    "skateboard": ("skateboard",), "surfboard": ("surfboard",), "tennis racket": ("tennis racket", "racket"),
    "bottle": ("bottle",), "wine glass": ("wine glass",), "cup": ("cup", "mug"), "fork": ("fork",),
    "knife": ("knife",), "spoon": ("spoon",), "bowl": ("bowl",), "banana": ("banana",), "apple": ("apple",),
    "sandwich": ("sandwich",), "orange": ("orange",), "broccoli": ("broccoli",), "carrot": ("carrot",),
    "hot dog": ("hot dog",), "pizza": ("pizza",), "donut": ("donut", "doughnut"), "cake": ("cake",),
    "chair": ("chair",), "couch": ("couch", "sofa"), "potted plant": ("potted plant", "plant"), "bed": ("bed",),
    "dining table": ("dining table", "table"), "toilet": ("toilet",), "tv": ("tv", "television"),
    "laptop": ("laptop",), "mouse": ("mouse",), "remote": ("remote", "remote control"), "keyboard": ("keyboard",),
    "cell phone": ("cell phone", "phone"), "microwave": ("microwave",), "oven": ("oven",), "toaster": ("toaster",),
    "sink": ("sink",), "refrigerator": ("refrigerator", "fridge"), "book": ("book",), "clock": ("clock",),
    "vase": ("vase",), "scissors": ("pair of scissors",), "teddy bear": ("teddy bear", "teddy"),
    "hair drier": ("hair drier", "hair dryer"), "toothbrush": ("toothbrush",),
}
# Plurals the -s/-es/-ies rule gets wrong; used only by "the bigger of the two ...".
PLURALS = {"person": "people", "mouse": "mice", "knife": "knives", "sheep": "sheep", "broccoli": "broccoli",
           "pair of skis": "pairs of skis", "pair of scissors": "pairs of scissors", "bus": "buses"}

# The phrases' words and templates ("{n}": the name, "{ns}": its plural, "{a}": the anchor, "the
# laptop"). Left/right ones are augment.hflip's (left, right, leftmost, rightmost), so a flipped
# sample's phrase stays true.
EXTREME_TEXTS = {
    "left": ("the leftmost {n}", "the {n} on the left"),
    "right": ("the rightmost {n}", "the {n} on the right"),
    "top": ("the top {n}", "the {n} at the top"),
    "bottom": ("the bottom {n}", "the {n} at the bottom"),
}
ORDINAL_WORDS = {2: "second", 3: "third", 4: "fourth", 5: "fifth"}
# Words of the templates that an attribute may not be: "the top cup" or "the small cup" would read
# both as a position/size and as the attribute. refgen drops such attribute words (--stats counts
# them).
RESERVED_WORDS = frozenset({"left", "right", "leftmost", "rightmost", "top", "bottom", "big", "large", "small",
                            "bigger", "smaller", "biggest", "largest", "smallest", *ORDINAL_WORDS.values()})
RELATION_WORDS = {
    "left of": ("left of", "to the left of"),
    "right of": ("right of", "to the right of"),
    "above": ("above",),
    "below": ("below", "under"),
    "next to": ("next to", "beside"),
}
RELATION_TEXTS = {rel: tuple(f"the {{n}} {w} {{a}}" for w in words) for rel, words in RELATION_WORDS.items()}
# Sets: "every cup", "all the red cups", "the cups left of the laptop". A template starting "the
# {ns}" is not used for a name whose plural is itself ("the sheep left of the laptop" would also
# read as one sheep).
SET_TEXTS = ("every {n}", "all the {ns}", "all {ns}")
SET_ATTRIBUTE_TEXTS = ("every {w} {{n}}", "all the {w} {{ns}}")
SET_RELATION_TEXTS = {rel: tuple(f"the {{ns}} {w} {{a}}" for w in words) + tuple(f"all the {{ns}} {w} {{a}}"
                                                                                for w in words)
                      for rel, words in RELATION_WORDS.items()}


def plural(name: str) -> str:
    """English plural of a category name (the last word's)."""
    if name in PLURALS:
        return PLURALS[name]
    if name.endswith(("s", "x", "ch", "sh")):
        return name + "es"
    if name.endswith("y") and name[-2:-1] not in "aeiou":
        return name[:-1] + "ies"
    return name + "s"
