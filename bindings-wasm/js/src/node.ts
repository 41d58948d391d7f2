// Node entry point: the module is ready on import (see node-init).
import "./node-init.js";

export * from "./index.js";

/** Resolves at once: on Node the module is instantiated when it is imported (the argument is ignored). */
export async function init(_wasm?: unknown): Promise<void> {}
