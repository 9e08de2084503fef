/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

/** Scala values that Java tests cannot build conveniently. */
object NativeEngineTestSupport {

  /** One block range, as the argument of [[ShuffleEngine.fetchBlocks]]. */
  def ranges(shuffleId: Int, mapId: Long, start: Int, end: Int): IndexedSeq[BlockRange] =
    IndexedSeq(BlockRange(shuffleId, mapId, start, end))
}
