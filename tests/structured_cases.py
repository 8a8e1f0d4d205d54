"""JSON schemas and regexes for the structured-output tests and benchmarks (no tests here).

Varied on purpose: nested objects, arrays with item bounds, enums, numbers with bounds, optional
fields, ``$ref``/``$defs``, ``anyOf``, ``const``, string formats. Strings carry ``maxLength`` and
arrays ``maxItems`` so that a sampled output finishes well inside the tests' token budget.
Keywords the grammar library refuses (``uniqueItems``, ``propertyNames``) are tested as 400s,
not here.
"""

from __future__ import annotations

_NAME = {"type": "string", "minLength": 1, "maxLength": 24}
_SHORT = {"type": "string", "maxLength": 32}

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    "enum_color": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue", "light yellow"]}},
        "required": ["color"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            "ok": {"type": "boolean"},
        },
        "required": ["temperature", "humidity", "ok"],
    },
    "nested_address": {
        "type": "object",
        "properties": {
            "name": _NAME,
            "address": {
                "type": "object",
                "properties": {"street": _SHORT, "city": _NAME,
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "tags_array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 4}},
        "required": ["tags"],
    },
    "exact_items": {
        "type": "object",
        "properties": {"scores": {"type": "array", "minItems": 3, "maxItems": 3,
                                  "items": {"type": "integer", "minimum": 1, "maximum": 10}}},
        "required": ["scores"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"title": _SHORT, "subtitle": _SHORT,
                       "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
        "required": ["title"],
    },
    "defs_ref": {
        "type": "object",
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": -100,
                                                 "maximum": 100},
                                           "y": {"type": "integer", "minimum": -100,
                                                 "maximum": 100}},
                            "required": ["x", "y"]}},
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "any_of": {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99999},
                                        {"type": "string", "pattern": "^[a-z]{3}-[0-9]{3}$"}]}},
        "required": ["id"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {"items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {"type": "object",
                      "properties": {"product": _NAME,
                                     "quantity": {"type": "integer", "minimum": 1,
                                                  "maximum": 50}},
                      "required": ["product", "quantity"]}}},
        "required": ["items"],
    },
    "const_version": {
        "type": "object",
        "properties": {"version": {"const": "1.0"}, "kind": {"enum": ["book", "film"]},
                       "name": _NAME},
        "required": ["version", "kind", "name"],
    },
    "nullable": {
        "type": "object",
        "properties": {"nickname": {"anyOf": [_NAME, {"type": "null"}]},
                       "active": {"type": "boolean"}},
        "required": ["nickname", "active"],
    },
    "deep_nesting": {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {
            "type": "object", "properties": {"c": {
                "type": "object", "properties": {"value": {"type": "integer", "minimum": 0,
                                                           "maximum": 9}},
                "required": ["value"]}},
            "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"],
    },
    "string_pattern": {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"},
                       "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
        "required": ["phone", "code"],
    },
    "enum_array": {
        "type": "object",
        "properties": {"days": {"type": "array", "minItems": 1, "maxItems": 7,
                                "items": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat",
                                                   "sun"]}}},
        "required": ["days"],
    },
    "top_level_array": {
        "type": "array", "minItems": 2, "maxItems": 4,
        "items": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "date_format": {
        "type": "object",
        "properties": {"event": _SHORT, "date": {"type": "string", "format": "date"}},
        "required": ["event", "date"],
    },
    "recipe": {
        "type": "object",
        "properties": {
            "title": _SHORT,
            "servings": {"type": "integer", "minimum": 1, "maximum": 12},
            "ingredients": {"type": "array", "minItems": 1, "maxItems": 4, "items": _SHORT},
            "vegetarian": {"type": "boolean"},
        },
        "required": ["title", "servings", "ingredients", "vegetarian"],
    },
    "any_of_objects": {
        "type": "object",
        "properties": {"shape": {"anyOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"},
                                              "radius": {"type": "integer", "minimum": 1,
                                                         "maximum": 100}},
             "required": ["kind", "radius"]},
            {"type": "object", "properties": {"kind": {"const": "square"},
                                              "side": {"type": "integer", "minimum": 1,
                                                       "maximum": 100}},
             "required": ["kind", "side"]}]}},
        "required": ["shape"],
    },
    "long_fixed_keys": {
        "type": "object",
        "properties": {
            "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 999},
            "preferred_communication_channel": {"enum": ["email", "phone"]},
            "subscription_renewal_confirmed": {"type": "boolean"},
            "additional_delivery_instructions": {"type": "string", "maxLength": 16},
        },
        "required": ["customer_identification_number", "preferred_communication_channel",
                     "subscription_renewal_confirmed", "additional_delivery_instructions"],
    },
    "map_of_ints": {
        "type": "object",
        "properties": {"counts": {"type": "object", "maxProperties": 3,
                                  "additionalProperties": {"type": "integer", "minimum": 0,
                                                           "maximum": 99}}},
        "required": ["counts"],
    },
    "ref_list": {
        "type": "object",
        "$defs": {"person": {"type": "object", "properties": {"name": _NAME, "role": {
            "enum": ["author", "editor"]}}, "required": ["name", "role"]}},
        "properties": {"people": {"type": "array", "minItems": 1, "maxItems": 2,
                                  "items": {"$ref": "#/$defs/person"}}},
        "required": ["people"],
    },
}

_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"

# Regexes whose matches the tests check with re.fullmatch.
REGEXES: dict[str, str] = {
    "ipv4": rf"({_OCTET}\.){{3}}{_OCTET}",
    "iso_date": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "time_24h": r"([01][0-9]|2[0-3]):[0-5][0-9]",
    "email": r"[a-z]{1,12}@[a-z]{1,10}\.(com|org|net)",
    "yes_no": r"(yes|no)",
    "hex_color": r"#[0-9a-f]{6}",
    "phone_us": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "word_list": r"[A-Z][a-z]{1,10}(, [A-Z][a-z]{1,10}){1,3}\.",
    "price": r"\$[1-9][0-9]{0,3}\.[0-9]{2}",
    "sentence": r"The answer is [0-9]{1,3}\.",
}

# A prompt per case: the model is asked for what the constraint enforces anyway.
def schema_prompt(name: str) -> str:
    return f"Reply with a JSON value for '{name.replace('_', ' ')}'."


def regex_prompt(name: str) -> str:
    return f"Write an example of a {name.replace('_', ' ')}."
