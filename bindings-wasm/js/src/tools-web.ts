// `highwater/tools` in browsers and bundlers: `await init()` once before calling anything else.
import initWasm, { type InitInput } from "./wasm/highwater_tools.js";

export * from "./tools.js";

/**
 * Loads and instantiates the tools' WebAssembly module; by default it is fetched from beside
 * this file. Safe to call more than once.
 */
export async function init(wasm?: InitInput | Promise<InitInput>): Promise<void> {
  await initWasm(wasm === undefined ? undefined : { module_or_path: wasm });
}
