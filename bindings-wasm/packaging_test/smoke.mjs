// What a user writes: one call of each family through the installed package.
import { compareWatermarks, cursorFromPayload, isHighwaterError, scopeDigest } from "highwater";
import { BackfillTracker, ScopeBridge, parseChangeStreamMessage } from "highwater/tools";

const results = {
  watermark: compareWatermarks("579e6a5", "579e6a5.01"),
  changeStream: parseChangeStreamMessage('["data",{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"new":{"id":9007199254740993}}]')[1].new.id,
  cursor: cursorFromPayload('{"id":1,"serverSequence":"7","updatedAt":"2026-07-01T10:00:00.000Z"}').serverSequence,
  scope: scopeDigest({ resourceType: "Task", conditions: { project_id: "p1" } }),
  backfill: new BackfillTracker([]).isEmpty,
  bridge: new ScopeBridge({ resourceTypes: ["Task"] }).state,
};
try {
  compareWatermarks("not a watermark", "00");
} catch (error) {
  results.error = isHighwaterError(error, "HW_INVALID_WATERMARK") && error.code;
}
console.log(JSON.stringify(results, (_, v) => (typeof v === "bigint" ? `${v}n` : v)));
