// The package's coded errors, thrown by either of its WebAssembly modules.
import type { HighwaterError, HighwaterErrorCode } from "./wasm/api.js";

/** True for errors thrown by this package; narrow further with `code`. */
export function isHighwaterError(error: unknown, code?: HighwaterErrorCode): error is HighwaterError {
  return (
    error instanceof Error &&
    error.name === "HighwaterError" &&
    typeof (error as Partial<HighwaterError>).code === "string" &&
    (code === undefined || (error as HighwaterError).code === code)
  );
}
