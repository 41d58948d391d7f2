// A JSON reader that keeps every number's source text, so tests can check big integers
// exactly without relying on the package under test.

/** A number as written in the JSON text. */
export class RawNumber {
  constructor(text) {
    this.text = text;
  }

  get isInteger() {
    return !/[.eE]/.test(this.text);
  }
}

/** Parses JSON text: numbers become `RawNumber`, objects `Map`s (insertion order = text order). */
export function parseRaw(text) {
  let i = 0;
  const fail = (what) => {
    throw new SyntaxError(`raw-json: expected ${what} at offset ${i}`);
  };
  const ws = () => {
    while (i < text.length && " \t\n\r".includes(text[i])) i++;
  };
  const value = () => {
    ws();
    const c = text[i];
    if (c === "{") {
      i++;
      const map = new Map();
      ws();
      if (text[i] === "}") return i++, map;
      for (;;) {
        ws();
        if (text[i] !== '"') fail("a key");
        const key = string();
        ws();
        if (text[i++] !== ":") fail("':'");
        map.set(key, value());
        ws();
        if (text[i] === ",") i++;
        else if (text[i] === "}") return i++, map;
        else fail("',' or '}'");
      }
    }
    if (c === "[") {
      i++;
      const items = [];
      ws();
      if (text[i] === "]") return i++, items;
      for (;;) {
        items.push(value());
        ws();
        if (text[i] === ",") i++;
        else if (text[i] === "]") return i++, items;
        else fail("',' or ']'");
      }
    }
    if (c === '"') return string();
    const literal = /^(?:true|false|null|-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?)/.exec(text.slice(i));
    if (!literal) fail("a value");
    i += literal[0].length;
    if (literal[0] === "true") return true;
    if (literal[0] === "false") return false;
    if (literal[0] === "null") return null;
    return new RawNumber(literal[0]);
  };
  const string = () => {
    const match = /^"(?:[^"\\]|\\.)*"/.exec(text.slice(i));
    if (!match) fail("a string");
    i += match[0].length;
    return JSON.parse(match[0]);
  };
  const result = value();
  ws();
  if (i !== text.length) fail("the end of the text");
  return result;
}

const MAX_SAFE = BigInt(Number.MAX_SAFE_INTEGER);

/**
 * Checks that everything in `expected` (a raw parse) is in `actual` (a raw parse): same
 * strings, booleans and nulls, integers with the same text, other numbers with the same value,
 * arrays of the same length, and every object key (extra keys in `actual` are reported
 * separately). Returns a list of differences with their paths.
 */
export function missingFrom(expected, actual, path = "$", out = { differences: [], added: [] }) {
  if (expected instanceof RawNumber) {
    const same =
      actual instanceof RawNumber &&
      (expected.isInteger && actual.isInteger
        ? expected.text === actual.text
        : Number(expected.text) === Number(actual.text));
    if (!same) out.differences.push(`${path}: ${expected.text} became ${describe(actual)}`);
  } else if (Array.isArray(expected)) {
    if (!Array.isArray(actual) || actual.length !== expected.length) {
      out.differences.push(`${path}: array of ${expected.length} became ${describe(actual)}`);
    } else {
      expected.forEach((item, k) => missingFrom(item, actual[k], `${path}[${k}]`, out));
    }
  } else if (expected instanceof Map) {
    if (!(actual instanceof Map)) {
      out.differences.push(`${path}: object became ${describe(actual)}`);
    } else {
      for (const [key, item] of expected) {
        if (!actual.has(key)) out.differences.push(`${path}.${key}: missing`);
        else missingFrom(item, actual.get(key), `${path}.${key}`, out);
      }
      for (const key of actual.keys()) if (!expected.has(key)) out.added.push(`${path}.${key}`);
    }
  } else if (expected !== actual) {
    out.differences.push(`${path}: ${JSON.stringify(expected)} became ${describe(actual)}`);
  }
  return out;
}

/**
 * Checks how a JS value from the package represents a raw parse: integers beyond ±(2^53 − 1)
 * must be exact `bigint`s, others `number`s, objects plain objects holding every key (the
 * engine may add normalised keys, e.g. `rowKey` beside a deprecated `keyColumns`).
 */
export function jsRepresentationErrors(raw, js, path = "$", errors = []) {
  if (raw instanceof RawNumber) {
    if (raw.isInteger) {
      const exact = BigInt(raw.text);
      const wide = exact > MAX_SAFE || exact < -MAX_SAFE;
      if (wide && (typeof js !== "bigint" || js !== exact)) {
        errors.push(`${path}: ${raw.text} should be the bigint ${exact}n, got ${describe(js)}`);
      }
      if (!wide && (typeof js !== "number" || js !== Number(exact))) {
        errors.push(`${path}: ${raw.text} should be a number, got ${describe(js)}`);
      }
    } else if (js !== Number(raw.text)) {
      errors.push(`${path}: ${raw.text} should be ${Number(raw.text)}, got ${describe(js)}`);
    }
  } else if (Array.isArray(raw)) {
    if (!Array.isArray(js) || js.length !== raw.length) errors.push(`${path}: should be an array`);
    else raw.forEach((item, k) => jsRepresentationErrors(item, js[k], `${path}[${k}]`, errors));
  } else if (raw instanceof Map) {
    if (js === null || typeof js !== "object" || Array.isArray(js)) {
      errors.push(`${path}: should be an object`);
    } else {
      for (const [key, item] of raw) {
        if (!Object.hasOwn(js, key)) errors.push(`${path}.${key}: missing`);
        else jsRepresentationErrors(item, js[key], `${path}.${key}`, errors);
      }
    }
  } else if (raw !== js) {
    errors.push(`${path}: ${JSON.stringify(raw)} became ${describe(js)}`);
  }
  return errors;
}

function describe(value) {
  if (value instanceof RawNumber) return value.text;
  if (value instanceof Map) return "an object";
  if (typeof value === "bigint") return `${value}n`;
  return JSON.stringify(value) ?? String(value);
}
