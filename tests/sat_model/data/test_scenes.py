"""Synthetic scenes: deterministic, varied, and every caption true of the boxes and pixels.

The caption checks parse the English independently of the generator: noun phrases
"a [size] [colour] shape" are matched against the recorded objects' attributes, and each
relation is checked against box centres.
"""

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from sat_model.data.scene_grammar import COLOURS, SHAPES, SIZES
from sat_model.data.scenes import Scene, SceneObject, generate_scene, generate_scenes, render_scene
from sat_model.data.text import tokenize
from sat_model.evaluation.grounding import ground_tokens

NUMBER = {"one": 1, "two": 2, "three": 3, "four": 4}
PHRASE = r"an? (?:(small|large) )?(\w+) (circle|square|triangle|star)"
RELATION = re.compile(rf"^{PHRASE} (to the left of|to the right of|above|below) {PHRASE}$")
SCENES = [generate_scene(seed=7, split="train", index=i) for i in range(150)]


def matching(objects: tuple[SceneObject, ...], size: str | None, colour: str, shape: str) -> list:
    return [
        o for o in objects if o.shape == shape and o.colour == colour and size in (None, o.size)
    ]


def relation_holds(a: SceneObject, rel: str, b: SceneObject) -> bool:
    (ax, ay), (bx, by) = a.centre, b.centre
    return {
        "to the left of": ax < bx,
        "to the right of": ax > bx,
        "above": ay < by,  # image y grows downwards
        "below": ay > by,
    }[rel]


def check_caption(scene: Scene, caption: str) -> None:
    objs, n = scene.objects, len(scene.objects)
    if m := RELATION.match(caption):
        s1, c1, h1, rel, s2, c2, h2 = m.groups()
        pairs = [
            (a, b)
            for a in matching(objs, s1, c1, h1)
            for b in matching(objs, s2, c2, h2)
            if a is not b
        ]
        assert any(relation_holds(a, rel, b) for a, b in pairs), caption
    elif m := re.match(r"^there (?:is|are) (.+)$", caption):
        said = {
            shape: NUMBER[num]
            for num, shape in re.findall(r"(\w+) (circle|square|triangle|star)s?", m[1])
        }
        assert said == dict(Counter(o.shape for o in objs)), caption
    elif m := re.match(r"^(\w+) shapes? on an? (\w+) background$", caption):
        assert NUMBER[m[1]] == n and m[2] == scene.background, caption
    elif m := re.match(rf"^{PHRASE} on an? (\w+) background$", caption):
        assert n == 1 and matching(objs, *m.groups()[:3]) and m[4] == scene.background, caption
    elif m := re.match(rf"^{PHRASE} (in the middle|on the \w+|at the \w+(?: \w+)?)$", caption):
        (o,) = objs
        assert matching(objs, *m.groups()[:3])
        cx, cy = o.centre
        third = lambda v: int(3 * v / scene.image_size)  # noqa: E731
        expect = {"left": (0, None), "right": (2, None), "top": (None, 0), "bottom": (None, 2)}
        words = m[4].split()[2:]
        want_x = [expect[w][0] for w in words if expect.get(w, (None,))[0] is not None] or [1]
        want_y = [expect[w][1] for w in words if expect.get(w, (None, None))[1] is not None] or [1]
        assert (third(cx), third(cy)) == (want_x[0], want_y[0]), caption
    else:  # an enumeration, with or without a count: the named objects are exactly the scene's
        m = re.match(r"^(?:(\w+) shapes?: )?(.+)$", caption)
        if m[1]:
            assert NUMBER[m[1]] == n, caption
        named = re.findall(PHRASE, m[2])
        assert len(named) == n, caption
        for size, colour, shape in named:
            found = matching(objs, size or None, colour, shape)
            assert found, f"{caption!r} names a {colour} {shape} not in the scene"
        assert Counter((c, h) for _, c, h in named) == Counter((o.colour, o.shape) for o in objs)


def test_generate_scene_is_deterministic_in_seed_split_and_index() -> None:
    a, b = generate_scene(3, "val", 11), generate_scene(3, "val", 11)
    assert a == b
    assert np.array_equal(np.asarray(render_scene(a)), np.asarray(render_scene(b)))
    assert generate_scene(4, "val", 11) != a
    assert generate_scene(3, "test", 11) != a


def test_every_caption_is_true_of_its_scene() -> None:
    for scene in SCENES:
        assert len(scene.captions) == 5
        for caption in scene.captions:
            check_caption(scene, caption)


def test_captions_name_colours_sizes_counts_and_relations() -> None:
    words = Counter(t for s in SCENES for c in s.captions for t in tokenize(c))
    for w in [*SHAPES, *COLOURS, *SIZES, "two", "three", "four", "left", "right", "above", "below"]:
        assert words[w] > 0, w


def test_captions_fit_the_default_maximum_caption_length() -> None:
    longest = max(len(tokenize(c)) for s in SCENES for c in s.captions)
    assert longest <= 20


def test_scenes_cover_every_shape_colour_size_background_and_object_count() -> None:
    objs = [o for s in SCENES for o in s.objects]
    assert {o.shape for o in objs} == set(SHAPES)
    assert {o.colour for o in objs} == set(COLOURS)
    assert {o.size for o in objs} == set(SIZES)
    assert {s.background for s in SCENES} == {"plain", "gradient", "textured"}
    assert {len(s.objects) for s in SCENES} == {1, 2, 3, 4}


def test_boxes_are_inside_the_image_apart_and_sized_as_specified() -> None:
    for scene in SCENES:
        boxes = [o.box for o in scene.objects]
        for o in scene.objects:
            x0, y0, x1, y1 = o.box
            assert 0 <= x0 < x1 <= 224 and 0 <= y0 < y1 <= 224
            # small 40-56 px, large 80-100 px; a star's tight box is ~0.9 of its footprint
            lo, hi = {"small": (40, 56), "large": (80, 100)}[o.size]
            assert 0.9 * lo <= max(x1 - x0, y1 - y0) <= hi + 1, o
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (a, b)


def test_each_object_is_drawn_in_its_box_in_its_colour() -> None:
    for scene in SCENES[:40]:
        pixels = np.asarray(render_scene(scene)).astype(int)  # (H, W, 3)
        for o in scene.objects:
            mask = (pixels == np.array(o.rgb)).all(-1)
            x0, y0, x1, y1 = o.box
            # other objects are >= 8 px away, so within 3 px of this box only it has this fill
            near = mask[max(int(y0) - 3, 0) : int(y1) + 4, max(int(x0) - 3, 0) : int(x1) + 4]
            ys, xs = np.nonzero(near)
            top, left = max(int(y0) - 3, 0), max(int(x0) - 3, 0)
            assert len(xs) > 0.3 * (x1 - x0) * (y1 - y0), o
            assert abs(xs.min() + left - x0) <= 1.5 and abs(xs.max() + left - x1) <= 1.5, o
            assert abs(ys.min() + top - y0) <= 1.5 and abs(ys.max() + top - y1) <= 1.5, o


def test_object_colours_stand_out_from_the_background() -> None:
    for scene in SCENES[:40]:
        pixels = np.asarray(render_scene(scene)).astype(float)
        corner = pixels[:3, :3].reshape(-1, 3).mean(0)  # objects keep a 4 px margin
        for o in scene.objects:
            assert np.abs(np.array(o.rgb) - corner).max() > 40, (scene.image_id, o.colour)


def test_plain_background_is_uniform_and_textured_background_is_not() -> None:
    plain = next(s for s in SCENES if s.background == "plain")
    textured = next(s for s in SCENES if s.background == "textured")
    edge = lambda s: np.asarray(render_scene(s))[:3].reshape(-1, 3)  # noqa: E731  top rows
    assert len(np.unique(edge(plain), axis=0)) == 1
    assert len(np.unique(edge(textured), axis=0)) > 10


def test_image_size_scales_objects_with_the_image() -> None:
    big = generate_scene(1, "train", 0, image_size=448)
    assert render_scene(big).size == (448, 448)
    for o in big.objects:
        assert max(o.box[2] - o.box[0], o.box[3] - o.box[1]) >= 0.9 * 80


def test_generate_scene_rejects_an_unknown_split() -> None:
    with pytest.raises(ValueError, match="holdout"):
        generate_scene(0, "holdout", 0)


def test_generate_scenes_writes_pngs_removes_stale_ones_and_is_reproducible(tmp_path: Path) -> None:
    (tmp_path / "train_09999.png").write_bytes(b"old")
    scenes = generate_scenes(tmp_path, {"train": 3, "val": 2}, seed=5, workers=1)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [
        "train_00000.png",
        "train_00001.png",
        "train_00002.png",
        "val_00000.png",
        "val_00001.png",
    ]
    first = {f: (tmp_path / f).read_bytes() for f in files}
    again = generate_scenes(tmp_path, {"train": 3, "val": 2}, seed=5, workers=1)
    assert again == scenes
    assert {f: (tmp_path / f).read_bytes() for f in files} == first
    # a split's images do not depend on the other splits' sizes
    assert generate_scene(5, "val", 1) == scenes[-1]


def test_generate_scenes_in_parallel_equals_serial(tmp_path: Path) -> None:
    serial = generate_scenes(tmp_path / "a", {"train": 70}, seed=2, workers=1)
    parallel = generate_scenes(tmp_path / "b", {"train": 70}, seed=2, workers=2)
    assert serial == parallel
    assert (tmp_path / "a/train_00069.png").read_bytes() == (
        tmp_path / "b/train_00069.png"
    ).read_bytes()


def box(x: float, y: float, side: float = 40) -> tuple[float, float, float, float]:
    return (x, y, x + side, y + side)


OBJECTS = (
    SceneObject("circle", "red", "large", box(10, 10, 90), box(10, 10, 90), (220, 40, 40)),
    SceneObject("square", "blue", "small", box(120, 10), box(120, 10), (40, 80, 225)),
    SceneObject("square", "red", "small", box(120, 120), box(120, 120), (220, 40, 40)),
)


def test_ground_tokens_maps_shape_nouns_to_matching_objects() -> None:
    tokens = ["a", "large", "red", "circle", "to", "the", "left", "of"]
    tokens += ["two", "squares", "and", "a", "red", "square"]
    got = ground_tokens(tokens, OBJECTS)
    assert got[3] == (0,)  # large red circle
    assert got[9] == (1, 2)  # "squares": both squares
    assert got[13] == (2,)  # "red square": only the red one
    assert all(g == () for i, g in enumerate(got) if i not in (3, 9, 13))


def test_ground_tokens_gives_nothing_for_a_hallucinated_object() -> None:
    assert ground_tokens(["a", "blue", "circle", "star"], OBJECTS) == [(), (), (), ()]


def test_ground_tokens_grounds_each_scene_object_named_in_its_first_caption() -> None:
    for scene in SCENES[:50]:
        tokens = tokenize(scene.captions[0])  # names every object, left to right, fully
        grounded = [g for g in ground_tokens(tokens, scene.objects) if g]
        assert len(grounded) == len(scene.objects)
        for k, g in enumerate(grounded):
            assert k in g
