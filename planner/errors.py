"""The planner's user-facing errors; the CLI maps each to an exit code."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config file or flag is invalid. ``str()`` is one line: file, field path, value, rule (a file
    name's or a key's control characters written as escapes)."""

    def __init__(self, source: str, field: str, value: object, rule: str):
        self.source = source
        self.field = field
        self.value = value
        self.rule = rule
        shown = shown_value(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"{escaped(source)}: {escaped(field) or '<root>'} = {shown}: {rule}")


class FieldRule(ValueError):
    """A rule between fields, broken, raised by a config's model validator: it names the field it reports
    and that field's value, so the loader's ConfigError names them instead of the whole mapping."""

    def __init__(self, field: str, value: object, rule: str):
        super().__init__(rule)
        self.field, self.value = field, value


def shown_value(value: object) -> str:
    """``repr(value)``, or for an int too long for Python to print (over 4,300 digits) its digit count."""
    try:
        return repr(value)
    except ValueError:  # int's string conversion limit
        return f"<an int of about {int(value.bit_length() * 0.30103) + 1:,} digits>" if isinstance(value, int) \
            else f"<a {type(value).__name__} too long to print>"


def escaped(text: str) -> str:
    """``text`` with line breaks and other control characters written as escapes."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


def one_line(text: str) -> str:
    """``text`` on one line, as the CLI prints an error: line breaks and other control characters
    (from a file name or a value) written as escapes."""
    return escaped(text.strip())


class PlanDoesNotFit(RuntimeError):
    """The plan needs more device memory than the serving config allows."""

    def __init__(self, message: str, *, required_bytes: int, usable_bytes: int,
                 advice: dict[str, object] | None = None):
        self.required_bytes = required_bytes
        self.usable_bytes = usable_bytes
        #: serving field -> a value at which the plan fits, each on its own (what the message advises)
        self.advice = dict(advice or {})
        super().__init__(message)
